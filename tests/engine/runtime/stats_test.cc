// The engine's statistics as named values (engine/runtime/stats.h): every key once in its
// group, groups balanced, values under their keys, the summary last.
#include "strata/engine/runtime/stats.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace strata::engine {
namespace {

// Each value as "path = text"; every path must be new.
class Flatten final : public StatsVisitor {
 public:
  void Enter(std::string_view key) override { Add(key, "{"), path_.push_back(std::string(key)); }
  void Leave() override {
    ASSERT_FALSE(path_.empty());
    path_.pop_back();
  }
  void Null(std::string_view key) override { Add(key, "null"); }
  void Value(std::string_view key, uint64_t v) override { Add(key, std::to_string(v)); }
  void Value(std::string_view key, int64_t v) override { Add(key, std::to_string(v)); }
  void Value(std::string_view key, double v) override { Add(key, std::to_string(v)); }
  void Value(std::string_view key, bool v) override { Add(key, v ? "true" : "false"); }
  void Value(std::string_view key, const std::string& v) override { Add(key, v); }
  void Value(std::string_view key, const std::vector<double>& v) override {
    Add(key, std::to_string(v.size()) + " doubles");
  }
  void Value(std::string_view key, const std::vector<uint64_t>& v) override {
    Add(key, std::to_string(v.size()) + " integers");
  }

  std::map<std::string, std::string> values;
  std::vector<std::string> order;
  std::vector<std::string> path_;
  std::set<std::string> duplicates;

 private:
  void Add(std::string_view key, const std::string& text) {
    std::string p;
    for (const std::string& part : path_)
      p += part + ".";
    p += key;
    if (!values.emplace(p, text).second) duplicates.insert(p);
    order.push_back(p);
  }
};

TEST(StatsTest, EveryValueOnceUnderItsKeyAndTheSummaryLast) {
  EngineStats s;
  s.device.name = "cpu arena";
  s.device.usage.peak_bytes = 4096;
  s.coordinator.fetches_prefetched = 7;
  s.reducer.gradients_parked = 3;
  s.optimizer.steps_applied = 11;
  s.optimizer.group_lr = {0.1, 0.2};
  s.store.relocations = 5;
  s.param_store_name = "nvme";
  s.reduce_lane = true;
  s.reduce_lane_comm.bytes_sent = 99;
  s.numa_node = -1;
  s.phases.backwards = 2;
  Flatten f;
  VisitStats(s, f);
  EXPECT_TRUE(f.duplicates.empty()) << *f.duplicates.begin();
  EXPECT_TRUE(f.path_.empty()) << "Enter without Leave";
  EXPECT_EQ(f.values["device.name"], "cpu arena");
  EXPECT_EQ(f.values["device.peak_bytes"], "4096");
  EXPECT_EQ(f.values["host"], "null");
  EXPECT_EQ(f.values["coordinator.fetches_prefetched"], "7");
  EXPECT_EQ(f.values["reducer.gradients_parked"], "3");
  EXPECT_EQ(f.values["optimizer.steps_applied"], "11");
  EXPECT_EQ(f.values["optimizer.group_lr"], "2 doubles");
  EXPECT_EQ(f.values["optimizer_store.relocations"], "5");
  EXPECT_EQ(f.values["param_store.name"], "nvme");
  EXPECT_EQ(f.values["reduce_lane"], "true");
  EXPECT_EQ(f.values["reduce_lane_comm.bytes_sent"], "99");
  EXPECT_EQ(f.values["numa_node"], "-1");
  EXPECT_EQ(f.values["phases.backwards"], "2");
  ASSERT_FALSE(f.order.empty());
  EXPECT_EQ(f.order.back(), "summary");
  EXPECT_EQ(f.values["summary"], s.ToString());
  EXPECT_GT(f.values.size(), 130u);  // every field of every component's statistics
}

}  // namespace
}  // namespace strata::engine
