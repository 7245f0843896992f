// The engine's statistics as named values (EngineStats, engine_core.h): VisitStats names
// every field once, with the key a front end shows it under, and every reader of the
// statistics takes them from there (the Python front end's dict, _strata's stats(); a
// JSON or CSV exporter would too). EngineStats::ToString is the summary for logs, a
// selection of the same values in sentences.
//
// Thread-safety: a function over its arguments.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/engine/runtime/engine_core.h"

namespace strata::engine {

// What VisitStats calls, in the order of the fields: Enter/Leave around a group of values
// (its key), Null for a group that is absent (the host tier of an engine without one).
class StatsVisitor {
 public:
  virtual ~StatsVisitor() = default;
  virtual void Enter(std::string_view key) = 0;
  virtual void Leave() = 0;
  virtual void Null(std::string_view key) = 0;
  virtual void Value(std::string_view key, uint64_t v) = 0;
  virtual void Value(std::string_view key, int64_t v) = 0;
  virtual void Value(std::string_view key, double v) = 0;
  virtual void Value(std::string_view key, bool v) = 0;
  virtual void Value(std::string_view key, const std::string& v) = 0;
  virtual void Value(std::string_view key, const std::vector<double>& v) = 0;
  virtual void Value(std::string_view key, const std::vector<uint64_t>& v) = 0;
};

// Every field of `s`, once, and last "summary" (s.ToString()).
void VisitStats(const EngineStats& s, StatsVisitor& v);

}  // namespace strata::engine
