// convert_bench: the engine's conversions between fp32 and 16-bit floats, one thread.
//
// The engine converts on one thread, per gradient and per group: a 16-bit gradient shard
// added into its fp32 accumulator (reducer), a gathered 16-bit group into its fp32 compute
// copy (fp16 on a CPU device), fp32 into a 16-bit bucket or working shard. For each
// conversion and 16-bit type it times:
//   element  a loop calling optim/cpu_adam's element converter per value (what the
//            engine's dtype.cc did before the bulk converters)
//   scalar, avx2, avx512   BulkToFloat / BulkAddToFloat / BulkAddToZeroedFloat (an
//            accumulator known zero, written with non-temporal stores and not read) /
//            BulkToHalf forced to that ISA
//   and, for the gradient written into a zeroed accumulator, the engine's two ways to get
//   the gradient norm's tiles of it: `norm pass` (the write, then GradSquaredNormTiles
//   reading it back: 6 + 4 B/val) and `+ norm` (CpuAdam::AddToZeroedWithNormTiles: the
//   squares summed as the values are written, 6 B/val), on a one-thread CpuAdam of that ISA
//            (the ISAs this CPU lacks are left out, and the header says so)
// and, once, `fp32 indexed bits sum` (BulkIndexedBitsSum: the checkpoints' frozen-base
// fingerprint over fp32 values, 4 B/val read; element: IndexedBitsTerm summed in a loop),
// beside `copy`, a memcpy of the same number of fp32 values (8 counted bytes per value),
// the bandwidth a conversion cannot beat by much. Every converted buffer is checked
// against the element converter's result. Times are medians of interleaved repetitions.
//
// Usage: convert_bench [--quick] [--size N]   (N values; default 1M, 16M and 64M)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::bench {
namespace {

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One warm-up round, then `reps` interleaved rounds; each function's median.
std::vector<double> Medians(const std::vector<std::function<void()>>& fns, int reps) {
  for (const auto& fn : fns)
    fn();
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t k = 0; k < fns.size(); ++k)
      t[k].push_back(Seconds(fns[k]));
  }
  std::vector<double> out;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    out.push_back(v[v.size() / 2]);
  }
  return out;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "convert_bench: FAILED: %s\n", what.c_str());
  std::exit(1);
}

int Main(int argc, char** argv) {
  bool quick = false;
  std::vector<size_t> sizes = {size_t{1} << 20, size_t{16} << 20, size_t{64} << 20};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
      sizes = {size_t{1} << 20};
    } else if (a == "--size" && i + 1 < argc) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(argv[++i], &end, 10);
      if (end == argv[i] || *end != '\0' || n == 0) {
        std::fprintf(stderr, "convert_bench: --size takes a positive integer, got '%s'\n", argv[i]);
        return 2;
      }
      sizes = {static_cast<size_t>(n)};
    } else {
      std::fprintf(stderr, "usage: convert_bench [--quick] [--size N]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  std::vector<CpuIsa> isas;
  std::string lacking;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupportsIsa(isa)) {
      isas.push_back(isa);
    } else {
      lacking += " " + std::string(CpuIsaName(isa));
    }
  }
  std::printf("convert_bench: one thread; ISAs measured:");
  for (CpuIsa isa : isas)
    std::printf(" %s", std::string(CpuIsaName(isa)).c_str());
  std::printf("%s%s\n", lacking.empty() ? "" : "; this CPU lacks:", lacking.c_str());
  std::printf("%7s  %-32s %-8s %6s %10s %8s %9s %9s\n", "size", "conversion", "kernel", "B/val",
              "Mvals/s", "GB/s", "vs copy", "vs elem");

  std::vector<std::unique_ptr<CpuAdam>> adams(3);  // one thread each, by ISA
  for (CpuIsa isa : isas) {
    Result<std::unique_ptr<CpuAdam>> a = CpuAdam::Create({isa, 1, -1});
    if (!a.ok()) Fail("CpuAdam::Create: " + a.status().ToString());
    adams[static_cast<size_t>(isa)] = *std::move(a);
  }
  auto adam_of = [&](CpuIsa isa) -> const CpuAdam& { return *adams[static_cast<size_t>(isa)]; };

  const int reps = quick ? 3 : 7;
  for (size_t n : sizes) {
    std::vector<float> f(n), acc(n), accz(n), out(n), copy_dst(n), want(n);
    std::vector<uint16_t> h(n), h_out(n);
    std::vector<double> tiles(CpuAdam::NumTiles(n)), want_tiles(CpuAdam::NumTiles(n));
    // The element loop of the write with the norm's tiles: the kernels' definition.
    auto element_norm = [&](bool bf) {
      for (size_t k = 0; k < tiles.size(); ++k) {
        double lanes[16] = {};
        const size_t b = k * CpuAdam::kTileElems, e = std::min(n, b + CpuAdam::kTileElems);
        for (size_t i = b; i < e; ++i) {
          const float y = 0.0f + (bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]));
          accz[i] = y;
          lanes[(i - b) % 16] += double(y) * double(y);
        }
        double s = 0.0;
        for (double l : lanes)
          s += l;
        tiles[k] = s;
      }
    };
    for (size_t i = 0; i < n; ++i)
      f[i] = static_cast<float>((i * 2654435761u) % 20000) * 1e-3f - 10.0f;
    for (ScalarType t : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
      const bool bf = t == ScalarType::kBFloat16;
      for (size_t i = 0; i < n; ++i)
        h[i] = bf ? FloatToBFloat16(f[i]) : FloatToFloat16(f[i]);
      const GradSpan src16{h.data(), n, t};
      const Param16Span dst16{h_out.data(), n, t};
      const std::string tn(ScalarTypeName(t));
      // The gradient into a zeroed accumulator and the norm's tiles of it: the write then
      // the norm pass reading it back, or both at once.
      const std::function<void(CpuIsa)> norm_pass = [&](CpuIsa isa) {
        BulkAddToZeroedFloat(src16, accz, isa);
        if (!adam_of(isa).GradSquaredNormTiles(GradSpan::Fp32(accz), tiles).ok()) {
          Fail("GradSquaredNormTiles");
        }
      };
      const std::function<void(CpuIsa)> fused_norm = [&](CpuIsa isa) {
        if (!adam_of(isa).AddToZeroedWithNormTiles(src16, accz, tiles).ok()) {
          Fail("AddToZeroedWithNormTiles");
        }
      };
      // Runs one of them over a dirty accumulator and checks the values and the tile sums
      // against the element loop's.
      auto check_norm = [&](const char* name, const std::function<void(CpuIsa)>& run, CpuIsa isa) {
        element_norm(bf);
        want_tiles = tiles;
        want = accz;
        std::fill(accz.begin(), accz.end(), 0.25f);
        run(isa);
        if (std::memcmp(tiles.data(), want_tiles.data(), tiles.size() * 8) != 0 ||
            std::memcmp(accz.data(), want.data(), n * 4) != 0) {
          Fail("fp32(=0) += " + tn + name);
        }
      };
      struct Conversion {
        std::string name;
        double bytes;
        std::function<void()> element;
        std::function<void(CpuIsa)> bulk;
        std::function<void(CpuIsa)> check;  // runs the kernel of the ISA and checks it
      };
      std::vector<Conversion> conversions = {
          {tn + " -> fp32", 6,
           [&] {
             for (size_t i = 0; i < n; ++i)
               out[i] = bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]);
           },
           [&](CpuIsa isa) { BulkToFloat(src16, out, isa); },
           [&](CpuIsa isa) {
             BulkToFloat(src16, out, isa);
             for (size_t i = 0; i < n; ++i) {
               const float w = bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]);
               if (std::memcmp(&out[i], &w, 4) != 0) Fail(tn + " -> fp32 at " + std::to_string(i));
             }
           }},
          {"fp32 += " + tn, 10,
           [&] {
             for (size_t i = 0; i < n; ++i)
               acc[i] += bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]);
           },
           [&](CpuIsa isa) { BulkAddToFloat(src16, acc, isa); },
           [&](CpuIsa isa) {
             std::fill(acc.begin(), acc.end(), 0.25f);
             BulkAddToFloat(src16, acc, isa);
             for (size_t i = 0; i < n; ++i) {
               const float w = 0.25f + (bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]));
               if (std::memcmp(&acc[i], &w, 4) != 0)
                 Fail("fp32 += " + tn + " at " + std::to_string(i));
             }
           }},
          {"fp32(=0) += " + tn, 6,  // the accumulator known zero: not read
           [&] {
             for (size_t i = 0; i < n; ++i)
               accz[i] = 0.0f + (bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]));
           },
           [&](CpuIsa isa) { BulkAddToZeroedFloat(src16, accz, isa); },
           [&](CpuIsa isa) {
             std::fill(accz.begin(), accz.end(), 0.25f);  // overwritten, not added to
             BulkAddToZeroedFloat(src16, accz, isa);
             for (size_t i = 0; i < n; ++i) {
               const float w = 0.0f + (bf ? BFloat16ToFloat(h[i]) : Float16ToFloat(h[i]));
               if (std::memcmp(&accz[i], &w, 4) != 0)
                 Fail("fp32(=0) += " + tn + " at " + std::to_string(i));
             }
           }},
          {"fp32(=0) += " + tn + ", norm pass", 10,  // the write, then the norm's tiles read
           [&] { element_norm(bf); }, norm_pass,
           [&](CpuIsa isa) { check_norm(", norm pass", norm_pass, isa); }},
          {"fp32(=0) += " + tn + " + norm", 6,  // the squares summed as the values are written
           [&] { element_norm(bf); }, fused_norm,
           [&](CpuIsa isa) { check_norm(" + norm", fused_norm, isa); }},
          {"fp32 -> " + tn, 6,
           [&] {
             for (size_t i = 0; i < n; ++i)
               h_out[i] = bf ? FloatToBFloat16(f[i]) : FloatToFloat16(f[i]);
           },
           [&](CpuIsa isa) { BulkToHalf(f, dst16, isa); },
           [&](CpuIsa isa) {
             BulkToHalf(f, dst16, isa);
             for (size_t i = 0; i < n; ++i) {
               if (h_out[i] != (bf ? FloatToBFloat16(f[i]) : FloatToFloat16(f[i]))) {
                 Fail("fp32 -> " + tn + " at " + std::to_string(i));
               }
             }
           }},
      };
      uint64_t sum = 0, want_sum = 0;
      auto element_sum = [&] {
        uint64_t acc_sum = 0;
        for (size_t i = 0; i < n; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &f[i], 4);
          acc_sum += IndexedBitsTerm(i + 7, bits);
        }
        want_sum = acc_sum;
      };
      if (bf) {  // type-independent: once
        conversions.push_back({"fp32 indexed bits sum", 4, element_sum,
                               [&](CpuIsa isa) { sum = BulkIndexedBitsSum(f, 7, isa); },
                               [&](CpuIsa isa) {
                                 element_sum();
                                 sum = BulkIndexedBitsSum(f, 7, isa);
                                 if (sum != want_sum) Fail("fp32 indexed bits sum");
                               }});
      }
      for (const Conversion& c : conversions) {
        std::vector<std::function<void()>> fns = {
            [&] { std::memcpy(copy_dst.data(), f.data(), n * sizeof(float)); }, c.element};
        for (CpuIsa isa : isas)
          fns.push_back([&c, isa] { c.bulk(isa); });
        const std::vector<double> t_s = Medians(fns, reps);
        for (CpuIsa isa : isas)  // every ISA's result, checked
          c.check(isa);
        const double N = static_cast<double>(n);
        const double copy_bw = 8.0 * N / t_s[0];
        auto row = [&](const char* kernel, double bytes, double secs) {
          char vs_elem[32] = "-";
          if (std::strcmp(kernel, "copy") != 0)
            std::snprintf(vs_elem, sizeof vs_elem, "%.2fx", t_s[1] / secs);
          std::printf("%6zuM  %-32s %-8s %6.0f %10.1f %8.2f %9.3f %9s\n", n >> 20, c.name.c_str(),
                      kernel, bytes, N / secs / 1e6, bytes * N / secs / 1e9,
                      bytes * N / secs / copy_bw, vs_elem);
        };
        row("copy", 8, t_s[0]);
        row("element", c.bytes, t_s[1]);
        for (size_t k = 0; k < isas.size(); ++k)
          row(std::string(CpuIsaName(isas[k])).c_str(), c.bytes, t_s[2 + k]);
      }
    }
  }
  std::printf(
      "B/val: counted bytes per value; vs copy: counted GB/s over memcpy's (8 B/val); vs elem: "
      "time of the element loop over the kernel's. Every result was checked.\n");
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  return strata::bench::Main(argc, argv);
}
