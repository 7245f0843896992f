// Internal to strata_core (not installed): what the configuration's parts share. config.cc
// defines the helpers on key paths and their spelling and the key table's index;
// config_validate.cc validates one parsed document against the table.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/config.h"

namespace strata::config_internal {

using ojson = nlohmann::ordered_json;
// The raw document keeps the order of the file, so errors are reported in that order.
using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------
// Small helpers.

std::string Lower(std::string_view s);
std::vector<std::string_view> Split(std::string_view s, char sep);
std::string Join(const std::vector<std::string_view>& parts, std::string_view sep);
// "a.b" for "a.b.c" (empty at the top), and "c".
std::string_view Parent(std::string_view path);
std::string_view LastComponent(std::string_view path);
std::string JoinPath(std::string_view prefix, std::string_view key);
// "/a/b/c" for "a.b.c".
ojson::json_pointer Pointer(std::string_view path);
// Edit distance on keys with case, '_' and '-' ignored, so "pinmemory" ~ "pin_memory".
std::string Squash(std::string_view s);
size_t EditDistance(const std::string& a, const std::string& b);
// A value for an error: its kind and (up to 60 characters of) its JSON.
std::string DescribeValue(const json& v);
// A number as the table's limits are written (15 significant digits).
std::string FormatNumber(double v);

// ---------------------------------------------------------------------------
// The table, indexed.

struct Index {
  std::map<std::string, const KeySpec*, std::less<>> by_path;
  std::map<std::string, const KeySpec*, std::less<>> by_alias_path;  // parent.alias
  std::map<std::string, std::vector<const KeySpec*>, std::less<>> children;

  Index();
};

const Index& GetIndex();

// Canonical spelling of an enum value (case-insensitive match), or empty.
std::string_view MatchChoice(const KeySpec& spec, std::string_view value);

// ---------------------------------------------------------------------------
// Validation of one document (config_validate.cc): every key checked against the table
// (unknown keys with a suggestion, types, ranges, the keys a `when` condition excludes), the
// normalized document built in table order with the defaults, then the checks across keys
// (the batch sizes, precision, stages, offload tiers, optimizer and schedule). Appends each
// problem to `errors`; returns the normalized document, or null when there were errors.
ojson ValidateDocument(const json& doc, const ValidateOptions& options,
                       std::vector<ConfigError>& errors);

}  // namespace strata::config_internal
