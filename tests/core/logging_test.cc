// Logging: levels, parsing, the rank prefix, sinks and the environment override.
#include "strata/core/logging.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace strata {
namespace {

// Captures log lines for the duration of a test and restores the global state.
class LoggingTest : public testing::Test {
 protected:
  void SetUp() override {
    saved_level_ = GetLogLevel();
    saved_rank_ = GetLogRank();
    SetLogSink([this](LogLevel level, std::string_view line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(level, std::string(line));
    });
  }
  void TearDown() override {
    SetLogSink(nullptr);
    SetLogLevel(saved_level_);
    SetLogRank(saved_rank_);
  }
  std::vector<std::pair<LogLevel, std::string>> Lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
  LogLevel saved_level_ = LogLevel::kInfo;
  int saved_rank_ = -1;
};

TEST(LogLevelTest, NamesAndParsing) {
  const std::vector<std::pair<LogLevel, std::string>> levels = {
      {LogLevel::kTrace, "trace"}, {LogLevel::kDebug, "debug"}, {LogLevel::kInfo, "info"},
      {LogLevel::kWarn, "warn"},   {LogLevel::kError, "error"}, {LogLevel::kOff, "off"},
  };
  for (const auto& [level, name] : levels) {
    EXPECT_EQ(LogLevelName(level), name);
    Result<LogLevel> parsed = ParseLogLevel(name);
    ASSERT_TRUE(parsed.ok()) << name;
    EXPECT_EQ(*parsed, level);
  }
  EXPECT_EQ(*ParseLogLevel("warning"), LogLevel::kWarn);
  // Operators type environment variables in capitals.
  EXPECT_EQ(*ParseLogLevel("DEBUG"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("Warn"), LogLevel::kWarn);
}

TEST(LogLevelTest, ParseErrors) {
  for (const char* bad : {"", "loud", "information", "3", "info "}) {
    Result<LogLevel> r = ParseLogLevel(bad);
    ASSERT_FALSE(r.ok()) << "\"" << bad << "\"";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), "unknown log level \"" + std::string(bad) +
                                        "\"; expected one of trace, debug, info, warn, error, off");
  }
}

TEST_F(LoggingTest, LevelFiltersMessages) {
  SetLogLevel(LogLevel::kWarn);
  EXPECT_EQ(GetLogLevel(), LogLevel::kWarn);
  EXPECT_FALSE(LogEnabled(LogLevel::kTrace));
  EXPECT_FALSE(LogEnabled(LogLevel::kDebug));
  EXPECT_FALSE(LogEnabled(LogLevel::kInfo));
  EXPECT_TRUE(LogEnabled(LogLevel::kWarn));
  EXPECT_TRUE(LogEnabled(LogLevel::kError));
  EXPECT_FALSE(LogEnabled(LogLevel::kOff));  // kOff is not a level to log at

  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  STRATA_LOG(kDebug) << "hidden " << count();
  STRATA_LOG(kInfo) << "hidden " << count();
  STRATA_LOG(kWarn) << "shown " << count();
  STRATA_LOG(kError) << "shown " << count();
  EXPECT_EQ(evaluated, 2) << "a disabled log statement must not evaluate its arguments";
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].first, LogLevel::kWarn);
  EXPECT_EQ(lines[1].first, LogLevel::kError);

  SetLogLevel(LogLevel::kOff);
  STRATA_LOG(kError) << "nothing at off";
  EXPECT_EQ(Lines().size(), 2u);

  SetLogLevel(LogLevel::kTrace);
  STRATA_LOG(kTrace) << "everything at trace";
  EXPECT_EQ(Lines().size(), 3u);
}

TEST_F(LoggingTest, LinePrefixWithoutAndWithRank) {
  SetLogLevel(LogLevel::kTrace);
  SetLogRank(-1);
  STRATA_LOG(kInfo) << "pinned " << 4 << " MiB";
  SetLogRank(3);
  EXPECT_EQ(GetLogRank(), 3);
  STRATA_LOG(kWarn) << "slow drive";
  STRATA_LOG(kError) << "e";
  STRATA_LOG(kDebug) << "d";
  STRATA_LOG(kTrace) << "t";
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0].second, "[strata I] pinned 4 MiB");
  EXPECT_EQ(lines[1].second, "[strata rank 3 W] slow drive");
  EXPECT_EQ(lines[2].second, "[strata rank 3 E] e");
  EXPECT_EQ(lines[3].second, "[strata rank 3 D] d");
  EXPECT_EQ(lines[4].second, "[strata rank 3 T] t");
}

TEST_F(LoggingTest, LinesFromManyThreadsArriveWhole) {
  SetLogLevel(LogLevel::kInfo);
  SetLogRank(-1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i)
        STRATA_LOG(kInfo) << "thread " << t << " line " << i;
    });
  }
  for (auto& th : threads)
    th.join();
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 800u);
  for (const auto& [level, line] : lines) {
    EXPECT_EQ(line.rfind("[strata I] thread ", 0), 0u) << line;
  }
}

TEST_F(LoggingTest, EmptySinkRestoresStderr) {
  SetLogLevel(LogLevel::kInfo);
  SetLogSink(nullptr);
  testing::internal::CaptureStderr();
  STRATA_LOG(kInfo) << "to stderr";
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("] to stderr\n"), std::string::npos) << err;
  EXPECT_TRUE(Lines().empty());
}

TEST(LogConfigTest, ConfigLevelAppliesWithoutEnvironment) {
  if (std::getenv("STRATA_LOG_LEVEL") != nullptr) {
    GTEST_SKIP() << "STRATA_LOG_LEVEL is set in this test's environment";
  }
  const LogLevel saved = GetLogLevel();
  SetLogLevelFromConfig(LogLevel::kError);
  EXPECT_EQ(GetLogLevel(), LogLevel::kError);
  SetLogLevelFromConfig(LogLevel::kDebug);
  EXPECT_EQ(GetLogLevel(), LogLevel::kDebug);
  SetLogLevel(saved);
}

// The environment is read once, when logging is first used; a death test in the
// "threadsafe" style re-runs this binary, so the child starts with the variable set.
TEST(LogConfigDeathTest, EnvironmentWinsOverConfig) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_EQ(setenv("STRATA_LOG_LEVEL", "error", 1), 0);
  EXPECT_EXIT(
      {
        SetLogLevelFromConfig(LogLevel::kDebug);
        std::exit(GetLogLevel() == LogLevel::kError ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  // An explicit SetLogLevel still works (the program asked for it).
  EXPECT_EXIT(
      {
        SetLogLevel(LogLevel::kTrace);
        std::exit(GetLogLevel() == LogLevel::kTrace ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  // Capitals work in the environment.
  ASSERT_EQ(setenv("STRATA_LOG_LEVEL", "DEBUG", 1), 0);
  EXPECT_EXIT(std::exit(GetLogLevel() == LogLevel::kDebug ? 0 : 1), testing::ExitedWithCode(0), "");
  // A bad value is reported and ignored.
  ASSERT_EQ(setenv("STRATA_LOG_LEVEL", "loud", 1), 0);
  EXPECT_EXIT(
      {
        const bool info = GetLogLevel() == LogLevel::kInfo;
        SetLogLevelFromConfig(LogLevel::kWarn);
        std::exit(info && GetLogLevel() == LogLevel::kWarn ? 0 : 1);
      },
      testing::ExitedWithCode(0), "STRATA_LOG_LEVEL: unknown log level \"loud\"");
  ASSERT_EQ(unsetenv("STRATA_LOG_LEVEL"), 0);
}

TEST(LogConfigDeathTest, RankFromEnvironment) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_EQ(setenv("RANK", "5", 1), 0);
  EXPECT_EXIT(
      {
        SetLogLevel(LogLevel::kInfo);
        STRATA_LOG(kWarn) << "from rank five";
        std::exit(GetLogRank() == 5 ? 0 : 1);
      },
      testing::ExitedWithCode(0), "\\[strata rank 5 W\\] from rank five");
  ASSERT_EQ(setenv("RANK", "x1", 1), 0);
  EXPECT_EXIT(std::exit(GetLogRank() == -1 ? 0 : 1), testing::ExitedWithCode(0), "");
  ASSERT_EQ(unsetenv("RANK"), 0);
}

}  // namespace
}  // namespace strata
