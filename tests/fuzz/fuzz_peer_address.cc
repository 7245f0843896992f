// ParsePeerAddress (comm/tcp_transport.h): the "<host> <port>" a rank reads from the
// rendezvous store before it connects. No crash, leak or undefined behaviour; what it
// accepts is a port in 1..65535 and a host that, written back with the port, parses to the
// same address; a refusal has a message.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "strata/comm/tcp_transport.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::comm::internal::ParsePeerAddress;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::Result<strata::comm::internal::PeerAddress> a = ParsePeerAddress(text);
  if (!a.ok()) {
    if (a.status().message().empty()) __builtin_trap();
    return 0;
  }
  if (a->port < 1 || a->port > 65535 || a->host.empty()) __builtin_trap();
  const std::string again = a->host + " " + std::to_string(a->port);
  strata::Result<strata::comm::internal::PeerAddress> b = ParsePeerAddress(again);
  if (!b.ok() || b->host != a->host || b->port != a->port) __builtin_trap();
  return 0;
}
