// Helpers shared by the config tests.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "strata/core/config.h"

namespace strata::testing_util {

inline ::testing::AssertionResult Contains(const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << haystack << "\" does not contain \"" << needle << "\"";
}

// Validates `json`, expecting success; returns the normalized document.
inline nlohmann::ordered_json ValidOrDie(std::string_view json, int world_size = 1) {
  ValidationResult r = ValidateConfigJson(json, {.world_size = world_size});
  EXPECT_TRUE(r.ok()) << "errors:\n" << r.ErrorsToString() << "for:\n" << json;
  return r.normalized;
}

// Validates `json`, expecting exactly one error, at `path`, whose message contains every
// fragment.
template <typename... Fragments>
::testing::AssertionResult OneError(std::string_view json, std::string_view path,
                                    const Fragments&... fragments) {
  ValidationResult r = ValidateConfigJson(json);
  if (r.errors.size() != 1) {
    return ::testing::AssertionFailure()
           << "expected 1 error at " << path << ", got " << r.errors.size() << ":\n"
           << r.ErrorsToString() << "for: " << json;
  }
  if (!r.normalized.is_null()) {
    return ::testing::AssertionFailure() << "normalized document is not null after an error";
  }
  const ConfigError& e = r.errors[0];
  if (e.path != path) {
    return ::testing::AssertionFailure()
           << "error path \"" << e.path << "\", expected \"" << path << "\": " << e.ToString();
  }
  for (const std::string& f : {std::string(fragments)...}) {
    if (e.message.find(f) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "message \"" << e.message << "\" lacks \"" << f << "\"";
    }
  }
  return ::testing::AssertionSuccess() << e.ToString();
}

}  // namespace strata::testing_util
