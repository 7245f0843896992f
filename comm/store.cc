// Torch-free stores: PrefixStore and the in-process store. c10d's TCPStore adapter lives in
// rendezvous.cc.
#include "strata/comm/store.h"

#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "strata/comm/rendezvous.h"

namespace strata::comm {
namespace {

class PrefixedStore final : public Store {
 public:
  PrefixedStore(std::string prefix, std::shared_ptr<Store> base)
      : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}

  Status Set(const std::string& key, const std::vector<uint8_t>& value) override {
    return base_->Set(prefix_ + key, value);
  }
  Result<std::vector<uint8_t>> Get(const std::string& key,
                                   std::chrono::milliseconds timeout) override {
    return base_->Get(prefix_ + key, timeout);
  }
  Result<int64_t> Add(const std::string& key, int64_t delta) override {
    return base_->Add(prefix_ + key, delta);
  }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys)
      full.push_back(prefix_ + k);
    return base_->Wait(full, timeout);
  }

 private:
  const std::string prefix_;
  const std::shared_ptr<Store> base_;
};

// Values of Add() are kept as decimal text, as c10d's stores keep them.
class InProcess final : public Store {
 public:
  Status Set(const std::string& key, const std::vector<uint8_t>& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
    return Status::Ok();
  }

  Result<std::vector<uint8_t>> Get(const std::string& key,
                                   std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return map_.count(key) > 0; })) {
      return DeadlineExceededError("store: key '" + key + "' not set within " +
                                   std::to_string(timeout.count()) + " ms");
    }
    return map_[key];
  }

  Result<int64_t> Add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        const auto& v = it->second;
        const char* begin = reinterpret_cast<const char*>(v.data());
        auto [ptr, ec] = std::from_chars(begin, begin + v.size(), value);
        if (ec != std::errc() || ptr != begin + v.size()) {
          return InvalidArgumentError("store: Add on key '" + key +
                                      "' whose value is not an integer");
        }
      }
      value += delta;
      const std::string text = std::to_string(value);
      map_[key] = std::vector<uint8_t>(text.begin(), text.end());
    }
    cv_.notify_all();
    return value;
  }

  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto all = [&] {
      for (const auto& k : keys) {
        if (map_.count(k) == 0) return false;
      }
      return true;
    };
    if (!cv_.wait_for(lock, timeout, all)) {
      std::string missing;
      for (const auto& k : keys) {
        if (map_.count(k) == 0) missing += (missing.empty() ? "'" : ", '") + k + "'";
      }
      return DeadlineExceededError("store: keys " + missing + " not set within " +
                                   std::to_string(timeout.count()) + " ms");
    }
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> map_;
};

}  // namespace

std::shared_ptr<Store> PrefixStore(std::string prefix, std::shared_ptr<Store> base) {
  return std::make_shared<PrefixedStore>(std::move(prefix), std::move(base));
}

std::shared_ptr<Store> InProcessStore() {
  return std::make_shared<InProcess>();
}

}  // namespace strata::comm
