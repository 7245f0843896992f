// A toy model for the engine tests: a deep linear regression written by hand (forward and
// backward computed here), driven through EngineCore exactly as a front end would, and a
// reference fp32 Adam over plain vectors (torch semantics, the CPU-Adam kernel's formula).
//
// Model: h_0 = x (D), h_{j+1} = W_{seq[j]} h_j + b_{seq[j]}, out = s * h_n,
// loss = 0.5 / B * sum ||out - y||^2. Group 0 (root) holds s, group k >= 1 holds W_k, b_k.
// The layer sequence seq may repeat or reorder layers between steps.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/check.h"
#include "strata/engine/runtime/engine_core.h"
#include "thread_comm.h"

namespace strata::engine::toy {

using testing::ThreadCommunicator;
using testing::ThreadGroup;

constexpr int kD = 5;       // odd on purpose
constexpr int kLayers = 3;  // groups 1..3
constexpr int kBatch = 12;  // global batch, divisible by 1..4
// What a freed gradient is overwritten with (EngineMicroStep): a late read shows as NaN.
constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

// Whether the suite runs in the stores' relocating test mode (ctest's RelocatingStore pass:
// STRATA_TEST_RELOCATING_STORE=1), and the name a store then reports.
inline bool RelocatingStoreMode() {
  const char* v = std::getenv("STRATA_TEST_RELOCATING_STORE");
  return v != nullptr && std::string(v) == "1";
}
inline std::string StoreName(const std::string& plain) {
  return RelocatingStoreMode() ? plain + " (relocating test mode)" : plain;
}

// params[g][i]: group g's parameter i.
using Params = std::vector<std::vector<std::vector<float>>>;

inline Params InitialParams() {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 0.4f);
  Params p(kLayers + 1);
  p[0] = {{1.0f}};
  for (int k = 1; k <= kLayers; ++k) {
    std::vector<float> w(kD * kD), b(kD);
    for (int i = 0; i < kD; ++i) {
      for (int j = 0; j < kD; ++j)
        w[i * kD + j] = (i == j ? 0.9f : 0.0f) + n(rng) * 0.5f;
    }
    for (float& x : b)
      x = n(rng);
    p[static_cast<size_t>(k)] = {w, b};
  }
  return p;
}

struct Batch {
  std::vector<float> x, y;  // kBatch * kD each
};

inline Batch MakeBatch(int step) {
  std::mt19937 rng(1000 + static_cast<unsigned>(step));
  std::normal_distribution<float> n(0.0f, 1.0f);
  Batch b;
  b.x.resize(kBatch * kD);
  b.y.resize(kBatch * kD);
  for (float& v : b.x)
    v = n(rng);
  for (int r = 0; r < kBatch; ++r) {
    for (int i = 0; i < kD; ++i) {
      float t = 0.3f;
      for (int j = 0; j < kD; ++j)
        t += 0.2f * static_cast<float>((i + 2 * j) % 5 - 2) * b.x[r * kD + j];
      b.y[r * kD + i] = t;
    }
  }
  return b;
}

// h_out = W h + b for rows [0, rows).
inline std::vector<float> LayerForward(const float* w, const float* b, const std::vector<float>& h,
                                       int rows) {
  std::vector<float> out(static_cast<size_t>(rows) * kD);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < kD; ++i) {
      float t = b[i];
      for (int j = 0; j < kD; ++j)
        t += w[i * kD + j] * h[r * kD + j];
      out[r * kD + i] = t;
    }
  }
  return out;
}

// Gradients of one use of a layer; returns dh_in.
inline std::vector<float> LayerBackward(const float* w, const std::vector<float>& h_in,
                                        const std::vector<float>& dh_out, int rows,
                                        std::vector<float>& dw, std::vector<float>& db) {
  dw.assign(kD * kD, 0.0f);
  db.assign(kD, 0.0f);
  std::vector<float> dh(static_cast<size_t>(rows) * kD, 0.0f);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < kD; ++i) {
      const float g = dh_out[r * kD + i];
      db[i] += g;
      for (int j = 0; j < kD; ++j) {
        dw[i * kD + j] += g * h_in[r * kD + j];
        dh[r * kD + j] += w[i * kD + j] * g;
      }
    }
  }
  return dh;
}

// The front end's view of a parameter: float values (converted from 16 bits if needed).
inline std::vector<float> ParamValues(const GatheredGroup& gg, size_t i) {
  std::vector<float> v(gg.layout->params[i].numel);
  ConvertToFloat(gg.param_data(i), gg.dtype, v.size(), v.data());
  return v;
}

// Callbacks that differ between the engine run and the reference run.
struct Driver {
  // Returns group g's parameter values (engine: Pre + FullBuffer).
  std::function<std::vector<std::vector<float>>(int g, Phase phase)> acquire;
  std::function<void(int g, Phase phase)> release;
  std::function<void(int g, int i, const std::vector<float>& grad)> grad;
};

// One forward + backward over rows [row0, row0 + rows) of `batch`, the loss normalized by
// `norm_rows` and multiplied by `mult`. Returns the unmultiplied loss of these rows.
inline double ForwardBackward(const Driver& d, const std::vector<int>& seq, const Batch& batch,
                              int row0, int rows, int norm_rows, double mult) {
  std::vector<std::vector<float>> hs;
  hs.emplace_back(batch.x.begin() + row0 * kD, batch.x.begin() + (row0 + rows) * kD);
  for (int k : seq) {
    auto p = d.acquire(k, Phase::kForward);
    hs.push_back(LayerForward(p[0].data(), p[1].data(), hs.back(), rows));
    d.release(k, Phase::kForward);
  }
  auto root = d.acquire(0, Phase::kForward);
  const float s = root[0][0];
  d.release(0, Phase::kForward);
  const std::vector<float>& hn = hs.back();
  double loss = 0.0;
  std::vector<float> dout(hn.size());
  for (size_t e = 0; e < hn.size(); ++e) {
    const float diff = s * hn[e] - batch.y[static_cast<size_t>(row0) * kD + e];
    loss += 0.5 * static_cast<double>(diff) * diff / norm_rows;
    dout[e] = static_cast<float>(diff * mult / norm_rows);
  }
  // Backward.
  root = d.acquire(0, Phase::kBackward);
  float ds = 0.0f;
  std::vector<float> dh(hn.size());
  for (size_t e = 0; e < hn.size(); ++e) {
    ds += dout[e] * hn[e];
    dh[e] = root[0][0] * dout[e];
  }
  d.grad(0, 0, {ds});
  d.release(0, Phase::kBackward);
  for (int j = static_cast<int>(seq.size()) - 1; j >= 0; --j) {
    const int k = seq[static_cast<size_t>(j)];
    auto p = d.acquire(k, Phase::kBackward);
    std::vector<float> dw, db;
    dh = LayerBackward(p[0].data(), hs[static_cast<size_t>(j)], dh, rows, dw, db);
    d.grad(k, 0, dw);
    d.grad(k, 1, db);
    d.release(k, Phase::kBackward);
  }
  return loss;
}

// ---------------------------------------------------------------------------
// The reference: plain fp32 parameters and Adam (torch semantics, the kernel's formula).

struct Reference {
  Params p = InitialParams();
  Params m, v;
  int64_t step = 0;
  AdamParams hp;
  double clip = 0.0;
  // Parameter groups: [group][param] -> weight decay and lr factor (empty: hp's, 1).
  std::vector<std::vector<double>> weight_decay_of, lr_factor_of;

  Reference(const AdamParams& adam, double clipping) : hp(adam), clip(clipping) {
    m = v = p;
    for (auto& g : m)
      for (auto& t : g)
        std::fill(t.begin(), t.end(), 0.0f);
    v = m;
  }

  // Accumulates gradients of one micro-step into acc.
  double MicroStep(const std::vector<int>& seq, const Batch& b, double mult, Params& acc) {
    Driver d;
    d.acquire = [&](int g, Phase) { return p[static_cast<size_t>(g)]; };
    d.release = [](int, Phase) {};
    d.grad = [&](int g, int i, const std::vector<float>& gr) {
      auto& a = acc[static_cast<size_t>(g)][static_cast<size_t>(i)];
      for (size_t e = 0; e < gr.size(); ++e)
        a[e] += gr[e];
    };
    return ForwardBackward(d, seq, b, 0, kBatch, kBatch, mult);
  }

  void Step(const Params& grads, double lr) {
    double sumsq = 0.0;
    for (auto& g : grads)
      for (auto& t : g)
        for (float x : t)
          sumsq += static_cast<double>(x) * x;
    const float sumsq_f = static_cast<float>(sumsq);
    const double norm = std::sqrt(static_cast<double>(sumsq_f));
    const double coef = clip > 0 ? std::min(1.0, clip / (norm + 1e-6)) : 1.0;
    ++step;
    const double bc1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
    const float gscale = 1.0f * static_cast<float>(coef);
    const float b1 = static_cast<float>(hp.beta1), b2 = static_cast<float>(hp.beta2);
    const float omb1 = static_cast<float>(1.0 - hp.beta1),
                omb2 = static_cast<float>(1.0 - hp.beta2);
    const float eps = static_cast<float>(hp.eps);
    const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    for (size_t g = 0; g < p.size(); ++g) {
      for (size_t i = 0; i < p[g].size(); ++i) {
        const double plr = lr_factor_of.empty() ? lr : lr * lr_factor_of[g][i];
        const double pwd = weight_decay_of.empty() ? hp.weight_decay : weight_decay_of[g][i];
        const float neg_step = static_cast<float>(-plr / bc1);
        const float decay = static_cast<float>(1.0 - plr * pwd);
        for (size_t e = 0; e < p[g][i].size(); ++e) {
          float& pp = p[g][i][e];
          float& mm = m[g][i][e];
          float& vv = v[g][i][e];
          const float gr = grads[g][i][e] * gscale;
          if (pwd != 0.0) pp *= decay;
          mm = std::fma(b1, mm, omb1 * gr);
          vv = std::fma(b2, vv, (omb2 * gr) * gr);
          const float den = std::fma(std::sqrt(vv), inv_sqrt_bc2, eps);
          pp = std::fma(neg_step, mm / den, pp);
        }
      }
    }
  }
};

inline Params ZerosLike(const Params& p) {
  Params z = p;
  for (auto& g : z)
    for (auto& t : g)
      std::fill(t.begin(), t.end(), 0.0f);
  return z;
}

// ---------------------------------------------------------------------------
// The engine run.

inline Config BaseConfig() {
  Config c;
  c.optimizer.lr = 0.02;
  c.optimizer.weight_decay = 0.01;
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.reduce_bucket_size = 64;
  c.zero.sub_group_size = 40;  // several CPU-Adam calls per step
  return c;
}

inline std::vector<GroupDesc> Groups(const Params& p) {
  std::vector<GroupDesc> groups;
  groups.push_back({"root", {{"scale", 1, p[0][0].data()}}});
  for (int k = 1; k <= kLayers; ++k) {
    const auto& g = p[static_cast<size_t>(k)];
    groups.push_back({"layer" + std::to_string(k),
                      {{"weight", g[0].size(), g[0].data()}, {"bias", g[1].size(), g[1].data()}}});
  }
  return groups;
}

inline EngineOptions TestOptions() {
  EngineOptions o;
  o.cpu_adam.num_threads = 1;
  return o;
}

// One micro-step through the engine: this rank's rows of the global batch. `tamper` may
// change a gradient before it goes to the engine; `gathered(g, phase)` is called once group
// g's values are gathered (its compute is about to run); `before_end` after the last
// gradient, before EndBackward.
inline Result<double> EngineMicroStep(
    EngineCore& e, const std::vector<int>& seq, const Batch& b,
    std::function<void(int, int, std::vector<float>&)> tamper = {},
    const std::function<void(int, Phase)>& gathered = {},
    const std::function<void()>& before_end = {}) {
  Status first;
  auto note = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  Driver d;
  d.acquire = [&](int g, Phase phase) {
    note(phase == Phase::kForward ? e.PreForward(g) : e.PreBackward(g));
    std::vector<std::vector<float>> vals;
    Result<GatheredGroup> gg = e.FullBuffer(g);
    note(gg.status());
    for (size_t i = 0; i < e.layout(g).params.size(); ++i) {
      vals.push_back(gg.ok() ? ParamValues(*gg, i)
                             : std::vector<float>(e.layout(g).params[i].numel, 0.0f));
    }
    if (gathered) gathered(g, phase);
    return vals;
  };
  d.release = [&](int g, Phase phase) {
    note(phase == Phase::kForward ? e.PostForward(g) : e.PostBackward(g));
  };
  d.grad = [&](int g, int i, const std::vector<float>& gr) {
    // As LibTorch's: the gradient is freed after its hook, so the engine keeps its owner
    // until the compute stream has read it. Freed, it is poisoned first: a read after its
    // owner went shows up as NaN.
    auto copy =
        std::shared_ptr<std::vector<float>>(new std::vector<float>(gr), [](std::vector<float>* v) {
          std::fill(v->begin(), v->end(), kPoison);
          delete v;
        });
    if (tamper) tamper(g, i, *copy);
    note(e.AddGradient(g, i, copy->data(), DType::kFloat32, copy));
  };
  const int rows = kBatch / e.world_size();
  const double loss = ForwardBackward(d, seq, b, e.rank() * rows, rows, kBatch, e.LossMultiplier());
  STRATA_RETURN_IF_ERROR(first);
  if (before_end) before_end();
  STRATA_RETURN_IF_ERROR(e.EndBackward());
  return loss;
}

inline Result<Params> TryEngineParams(EngineCore& e) {
  Params out = InitialParams();
  for (int g = 0; g < e.num_groups(); ++g) {
    std::vector<float> flat(e.layout(g).numel);
    STRATA_RETURN_IF_ERROR(e.GatherMasterParams(g, flat));
    size_t pos = 0;
    for (auto& t : out[static_cast<size_t>(g)]) {
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(pos), t.size(), t.begin());
      pos += t.size();
    }
  }
  return out;
}

inline Params EngineParams(EngineCore& e) {
  Result<Params> p = TryEngineParams(e);
  STRATA_CHECK_OK(p.status());
  return *std::move(p);
}

inline double RelDiff(const Params& a, const Params& b) {
  double num = 0.0, den = 0.0;
  for (size_t g = 0; g < a.size(); ++g)
    for (size_t i = 0; i < a[g].size(); ++i)
      for (size_t e = 0; e < a[g][i].size(); ++e) {
        const double d = static_cast<double>(a[g][i][e]) - b[g][i][e];
        num += d * d;
        den += static_cast<double>(b[g][i][e]) * b[g][i][e];
      }
  return std::sqrt(num / den);
}

// Whether two float vectors hold the same bits.
inline bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline std::shared_ptr<comm::Communicator> SingleRank() {
  return std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(1), 0);
}

// Null (the error printed) when the engine cannot be created.
inline std::unique_ptr<EngineCore> MakeEngine(const Config& c,
                                              std::shared_ptr<comm::Communicator> comm,
                                              const Params& init,
                                              const EngineOptions& options = TestOptions()) {
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, std::move(comm), Groups(init), options);
  if (!e.ok()) {
    std::fprintf(stderr, "EngineCore::Create: %s\n", e.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(e);
}

inline std::vector<int> Seq(int step) {
  (void)step;
  return {1, 2, 3};
}

// Each rank's loss of the first micro-step of a model built from `v` (same batch index).
inline std::vector<double> LossOfModelBuiltFrom(const Config& c, int world, const Params& v,
                                                int batch) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<double> loss(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<EngineCore> e =
          MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), v);
      STRATA_CHECK(e != nullptr);
      Result<double> l = EngineMicroStep(*e, Seq(batch), MakeBatch(batch));
      STRATA_CHECK_OK(l.status());
      loss[static_cast<size_t>(r)] = *l;
      STRATA_CHECK_OK(e->Step().status());
    });
  }
  for (auto& t : threads)
    t.join();
  return loss;
}

struct RankResult {
  Params params;
  std::vector<double> losses;
  EngineStats stats;
  Status status;
};

inline RankResult RunRank(const Config& c, std::shared_ptr<comm::Communicator> comm, int steps) {
  RankResult r;
  const Params init = InitialParams();
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, std::move(comm), Groups(init), TestOptions());
  if (!e.ok()) {
    r.status = e.status();
    return r;
  }
  for (int step = 0; step < steps; ++step) {
    Result<double> loss = EngineMicroStep(**e, Seq(step), MakeBatch(step));
    if (!loss.ok()) {
      r.status = loss.status();
      return r;
    }
    r.losses.push_back(*loss);
    Result<StepOutcome> out = (*e)->Step();
    if (!out.ok()) {
      r.status = out.status();
      return r;
    }
  }
  r.params = EngineParams(**e);
  r.stats = (*e)->stats();
  return r;
}

}  // namespace strata::engine::toy
