// Shared by checkpoint_test.cc and checkpoint_crash_child.cc: the toy model (toy_model.h)
// trained on `world` thread ranks over steps [from, to), optionally loading a checkpoint
// first and saving one at the end.
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "strata/engine/runtime/engine_core.h"
#include "toy_model.h"

namespace strata::engine::toy {

struct CkptRun {
  std::vector<double> losses;
  Params params;
  std::vector<float> exp_avg, exp_avg_sq;  // this rank's partition
  ModelPartition partition;
  int64_t adam_step = 0;
  int64_t global_steps = 0;
  double loss_scale = 1.0;
  double lr = 0.0;
  Status load, train, save;
  CheckpointLoadResult loaded;
  std::string saved_path;
};

struct CkptPlan {
  int from = 0, to = 0;        // steps (each gradient_accumulation_steps micro-steps)
  CheckpointLoadRequest load;  // load.dir empty: no load
  CheckpointSaveRequest save;  // save.dir empty: no save
  // Each rank saves a blob "rank" holding "rank <r>".
  bool rank_blob = true;
};

inline std::vector<std::byte> Bytes(const std::string& s) {
  std::vector<std::byte> b(s.size());
  for (size_t i = 0; i < s.size(); ++i)
    b[i] = static_cast<std::byte>(s[i]);
  return b;
}

inline std::vector<CkptRun> CkptTrain(const Config& c, int world, const Params& init,
                                      const CkptPlan& plan) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<CkptRun> runs(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CkptRun& run = runs[static_cast<size_t>(r)];
      std::unique_ptr<EngineCore> e =
          MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), init);
      if (e == nullptr) {
        run.train = InternalError("no engine");
        return;
      }
      if (!plan.load.dir.empty()) {
        Result<CheckpointLoadResult> l = e->LoadCheckpoint(plan.load);
        run.load = l.status();
        if (l.ok()) run.loaded = *l;
      }
      const int gas = static_cast<int>(c.gradient_accumulation_steps);
      for (int s = plan.from; s < plan.to && run.train.ok(); ++s) {
        for (int m = 0; m < gas && run.train.ok(); ++m) {
          Result<double> loss = EngineMicroStep(*e, Seq(s), MakeBatch(s * gas + m));
          run.train = loss.status();
          if (loss.ok()) run.losses.push_back(*loss);
          if (run.train.ok()) run.train = e->Step().status();
        }
      }
      if (!plan.save.dir.empty() && run.train.ok()) {
        CheckpointSaveRequest so = plan.save;
        if (plan.rank_blob) {
          so.blobs.push_back({"rank", Bytes("rank " + std::to_string(r)), "U8", {}});
          // The same name on every rank, other values: rank 0's is kept.
          std::vector<float> v(6);
          for (size_t i = 0; i < v.size(); ++i)
            v[i] = static_cast<float>(r * 10 + i);
          CheckpointBlob shared{"shared:frozen", std::vector<std::byte>(24), "F32", {2, 3}};
          std::memcpy(shared.bytes.data(), v.data(), 24);
          so.blobs.push_back(std::move(shared));
        }
        Result<std::string> p = e->SaveCheckpoint(so);
        run.save = p.status();
        if (p.ok()) run.saved_path = *p;
      }
      run.params = EngineParams(*e);
      run.exp_avg = *e->optimizer().CopyState(OptimizerState::kExpAvg);
      run.exp_avg_sq = *e->optimizer().CopyState(OptimizerState::kExpAvgSq);
      run.partition = e->partition();
      run.adam_step = e->optimizer().adam_step();
      run.global_steps = e->stats().global_steps;
      run.loss_scale = e->loss_scale();
      run.lr = e->lr();
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

}  // namespace strata::engine::toy
