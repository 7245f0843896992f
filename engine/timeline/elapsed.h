// AddElapsed: adds the wall seconds of its scope to a counter (the engine's statistics of
// exposed, waited time). Header-only; not thread-safe (one counter, one thread).
#pragma once

#include <chrono>

namespace strata::engine {

class AddElapsed {
 public:
  explicit AddElapsed(double& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~AddElapsed() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  AddElapsed(const AddElapsed&) = delete;
  AddElapsed& operator=(const AddElapsed&) = delete;

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace strata::engine
