// SafetensorsReader over arbitrary file contents: no crash, leak or undefined behaviour;
// every tensor it accepts lies inside the file with exactly numel x dtype-size bytes, and
// reading it (floating-point ones, up to 64 Ki elements) succeeds; what it refuses it names.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fuzz_file.h"
#include "strata/engine/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::engine::SafetensorsReader;
  const std::string path = strata::fuzz::ScratchDir() + "/input.safetensors";
  strata::fuzz::WriteInput(path, data, size);
  strata::Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
  if (!r.ok()) {
    if (r.status().message().empty()) __builtin_trap();
    return 0;
  }
  std::vector<float> out;
  for (const auto& [name, t] : (*r)->tensors()) {
    if (t.offset > size || t.bytes > size - t.offset) __builtin_trap();  // outside the file
    if (!SafetensorsReader::IsFloatDType(t.dtype) || t.numel > (uint64_t{1} << 16)) continue;
    out.assign(static_cast<size_t>(t.numel), 0.0f);
    const strata::Status s = (*r)->ReadFloat(name, 0, out);
    if (!s.ok()) __builtin_trap();  // accepted, inside the file: it must read
  }
  return 0;
}
