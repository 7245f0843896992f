// Logging with levels and a rank-aware prefix.
//
//   STRATA_LOG(kInfo) << "pinned " << FormatBytes(n) << " on node " << node;
//
// Lines look like "[strata rank 1 W] message" (the rank part only once a rank is
// known: SetLogRank(), or the RANK environment variable of torchrun). The level comes
// from STRATA_LOG_LEVEL (trace|debug|info|warn|error|off, any case) at start-up, from the
// config's strata.log_level, or from SetLogLevel(); the environment variable wins over
// the config so an operator can turn on debug output without editing files.
//
// Thread-safety: all functions may be called from any thread; each line is written
// to stderr (or the installed sink) whole.
#pragma once

#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

enum class LogLevel : int { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

std::string_view LogLevelName(LogLevel level);  // "trace", ..., "off"
// Case-insensitive; "warning" is accepted for warn.
Result<LogLevel> ParseLogLevel(std::string_view name);

LogLevel GetLogLevel();
void SetLogLevel(LogLevel level);
// Applies a configured level unless STRATA_LOG_LEVEL is set in the environment.
void SetLogLevelFromConfig(LogLevel level);
bool LogEnabled(LogLevel level);

// The rank shown in the prefix; -1 hides it.
void SetLogRank(int rank);
int GetLogRank();

// Replaces the sink (default: stderr). Used by tests to capture log lines; pass an
// empty function to restore stderr. The sink receives the full line without '\n'; it
// runs under the logging lock, so it must not log itself.
using LogSink = std::function<void(LogLevel, std::string_view line)>;
void SetLogSink(LogSink sink);

namespace internal {
class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return os_; }

 private:
  LogLevel level_;
  std::ostringstream os_;
};
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace internal
}  // namespace strata

#define STRATA_LOG(level)                          \
  !::strata::LogEnabled(::strata::LogLevel::level) \
      ? (void)0                                    \
      : ::strata::internal::LogVoidify() &         \
            ::strata::internal::LogMessage(::strata::LogLevel::level).stream()
