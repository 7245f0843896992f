#include "strata/core/logging.h"

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace strata {
namespace {

struct LogState {
  std::atomic<int> level{static_cast<int>(LogLevel::kInfo)};
  std::atomic<bool> level_from_env{false};
  std::atomic<int> rank{-1};
  std::mutex mu;  // guards sink and serializes writes
  LogSink sink;

  LogState() {
    if (const char* env = std::getenv("STRATA_LOG_LEVEL"); env && *env) {
      auto parsed = ParseLogLevel(env);
      if (parsed.ok()) {
        level = static_cast<int>(*parsed);
        level_from_env = true;
      } else {
        std::fprintf(stderr, "[strata W] STRATA_LOG_LEVEL: %s; using info\n",
                     parsed.status().message().c_str());
      }
    }
    if (const char* env = std::getenv("RANK"); env && *env) {
      char* end = nullptr;
      long r = std::strtol(env, &end, 10);
      if (end && *end == '\0' && r >= 0) rank = static_cast<int>(r);
    }
  }
};

LogState& State() {
  static LogState* state = new LogState();  // never destroyed: usable during exit
  return *state;
}

char LevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return 'T';
    case LogLevel::kDebug:
      return 'D';
    case LogLevel::kInfo:
      return 'I';
    case LogLevel::kWarn:
      return 'W';
    case LogLevel::kError:
      return 'E';
    case LogLevel::kOff:
      return '-';
  }
  return '?';
}

}  // namespace

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return "trace";
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
    case LogLevel::kOff:
      return "off";
  }
  return "?";
}

Result<LogLevel> ParseLogLevel(std::string_view name) {
  // Case-insensitive: operators write STRATA_LOG_LEVEL=DEBUG as often as debug.
  std::string lower(name);
  for (char& c : lower) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  for (int i = 0; i <= static_cast<int>(LogLevel::kOff); ++i) {
    auto level = static_cast<LogLevel>(i);
    if (lower == LogLevelName(level)) return level;
  }
  if (lower == "warning") return LogLevel::kWarn;
  return InvalidArgumentError("unknown log level \"" + std::string(name) +
                              "\"; expected one of trace, debug, info, warn, error, off");
}

LogLevel GetLogLevel() {
  return static_cast<LogLevel>(State().level.load());
}
void SetLogLevel(LogLevel level) {
  State().level = static_cast<int>(level);
}
void SetLogLevelFromConfig(LogLevel level) {
  if (!State().level_from_env) SetLogLevel(level);
}
bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= State().level.load();
}
void SetLogRank(int rank) {
  State().rank = rank;
}
int GetLogRank() {
  return State().rank.load();
}

void SetLogSink(LogSink sink) {
  std::lock_guard<std::mutex> lock(State().mu);
  State().sink = std::move(sink);
}

namespace internal {

LogMessage::~LogMessage() {
  LogState& st = State();
  std::string line = "[strata ";
  if (int r = st.rank.load(); r >= 0) line += "rank " + std::to_string(r) + " ";
  line += LevelLetter(level_);
  line += "] ";
  line += os_.str();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.sink) {
    st.sink(level_, line);
  } else {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
}

}  // namespace internal
}  // namespace strata
