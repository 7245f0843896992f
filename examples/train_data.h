// Torch-free parts of strata-train: the byte-level corpus, the sampler that fixes the
// data order, the per-step metrics file and the progress line.
//
// Thread-safety: none of these types is thread-safe; strata-train drives them from its
// one training thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::train {

// A text file read as bytes (the vocabulary is the 256 byte values).
struct Corpus {
  std::string name;  // where it came from, for messages
  std::vector<uint8_t> bytes;
};

// Reads `path` whole. InvalidArgument when it is unreadable or empty.
Result<Corpus> LoadCorpusFile(const std::string& path);

// The embedded default corpus, the project's own documentation. Looked up, in order:
//   1. <directory of the executable>/../share/strata/strata-train-corpus.txt (generated at
//      build time from README.md and docs/**/*.md; installed beside the binaries);
//   2. the source tree the program was built from (`source_dir`): README.md and
//      docs/**/*.md concatenated in name order at run time.
// NotFound naming every place looked at when neither is there.
Result<Corpus> LoadDefaultCorpus(const std::string& source_dir);

// Draws training windows in a fixed order: step s, micro-step m gives a global batch of
// `global_rows` windows of seq_len + 1 bytes (inputs and the next-byte targets), the
// same for every world size. Rank r trains on rows [r * rows_per_rank, (r + 1) *
// rows_per_rank); the baseline trains on all of them.
class Sampler {
 public:
  Sampler(const Corpus& corpus, int64_t seq_len, uint64_t seed);
  // Offsets of the next global micro-batch (global_rows windows).
  std::vector<int64_t> NextOffsets(int64_t global_rows);
  int64_t seq_len() const { return seq_len_; }
  // The generator's exact state as text (a checkpoint's data position), and back;
  // InvalidArgument for text that is not one.
  std::string State() const;
  Status SetState(const std::string& state);

 private:
  int64_t seq_len_;
  int64_t positions_;  // valid window starts
  std::mt19937_64 rng_;
};

// One row of the metrics file.
struct StepMetrics {
  int64_t step = 0;  // optimizer steps, from 1
  double loss = 0;   // mean over the step's micro-batches (and ranks)
  double lr = 0;     // the rate the step used
  double tokens_per_s = 0;
  uint64_t device_bytes = 0, device_peak_bytes = 0;
  uint64_t host_bytes = 0, host_peak_bytes = 0;
  double elapsed_s = 0;  // since the first step started
  // The step's phases (the engine's PhaseStats over its micro-steps) and the time the
  // engine's thread waited in it (all-gathers, shard staging, reductions and their copies,
  // working-shard pushes, NVMe reads).
  double forward_s = 0, backward_s = 0, step_s = 0, waited_s = 0;
  // Model TFLOPS of the step (core/throughput.h: 6 x parameters + attention per token, all
  // ranks) and the model FLOPs utilization against the peak (0: no peak known).
  double tflops = 0, mfu = 0;
};

// The metrics file: FILE.csv -> CSV with a header line, FILE.jsonl -> one JSON object
// per line. Columns: step, loss, lr, tokens_per_s, device_bytes, device_peak_bytes,
// host_bytes, host_peak_bytes, elapsed_s, forward_s, backward_s, step_s, waited_s, tflops,
// mfu. Each row is flushed as it is written.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // InvalidArgument for another extension; the errno status when it cannot be created.
  Status Open(const std::string& path);
  bool is_open() const { return file_ != nullptr; }
  Status Write(const StepMetrics& m);
  Status Close();

 private:
  std::FILE* file_ = nullptr;
  bool jsonl_ = false;
  std::string path_;
};

// What the process holds, from /proc/self (Linux): for strata-train --resources-every and
// the soak (bench/soak.py), which watch these stay flat over a long run.
struct ProcessResources {
  uint64_t rss_bytes = 0;     // VmRSS
  uint64_t locked_bytes = 0;  // VmLck (mlock)
  uint64_t pinned_bytes = 0;  // VmPin (pages the kernel pinned: io_uring's registered buffers)
  int64_t open_fds = 0;
  // Allocated bytes (st_blocks) of the regular files the process has open under any of the
  // given directories (the swap files, unlinked or not), each file once.
  uint64_t swap_file_bytes = 0;
};
Result<ProcessResources> ReadProcessResources(const std::vector<std::string>& swap_dirs);

// Progress on stderr: redrawn in place on a terminal, else one line every `every` steps
// (and the last).
class Progress {
 public:
  Progress(bool enabled, int64_t total_steps, int64_t every);
  void Update(const StepMetrics& m, uint64_t device_budget);
  void Finish();

 private:
  bool enabled_;
  bool tty_;
  int64_t total_;
  int64_t every_;
  bool drawn_ = false;
};

}  // namespace strata::train
