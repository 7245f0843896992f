// ReadCheckpointManifest over arbitrary manifest.json contents, then, for a manifest it
// accepts whose rank files add up to at most 1 MiB, those files made (zeros) and every
// tensor verified and the model exported to safetensors (the consolidation's index math
// over fuzzed group layouts): no crash, leak or undefined behaviour; refusals are named.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_file.h"
#include "strata/engine/checkpoint/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace se = strata::engine;
  static const std::string tag_dir = [] {
    const std::string d = strata::fuzz::ScratchDir() + "/tag";
    ::mkdir(d.c_str(), 0755);
    return d;
  }();
  strata::fuzz::WriteInput(tag_dir + "/manifest.json", data, size);
  strata::Result<se::CheckpointManifest> m = se::ReadCheckpointManifest(tag_dir);
  if (!m.ok()) {
    if (m.status().message().empty()) __builtin_trap();
    return 0;
  }
  if (m->ranks.empty() || m->ranks.size() != static_cast<size_t>(m->world_size)) __builtin_trap();
  if (m->total_bytes() > (uint64_t{1} << 20)) return 0;
  for (const se::CheckpointRankPart& part : m->ranks) {
    const std::string path = tag_dir + "/" + part.file;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(part.file_bytes)) != 0) __builtin_trap();
    ::close(fd);
  }
  for (const se::CheckpointRankPart& part : m->ranks) {
    for (const se::CheckpointTensor& t : part.tensors) {
      const strata::Status s = se::VerifyCheckpointTensor(tag_dir, *m, part, t);
      if (!s.ok() && s.message().empty()) __builtin_trap();
    }
  }
  const std::string out = strata::fuzz::ScratchDir() + "/out.safetensors";
  strata::Result<se::CheckpointExportStats> e =
      se::ExportCheckpointSafetensors(tag_dir, *m, out, "BF16");
  if (!e.ok() && e.status().message().empty()) __builtin_trap();
  for (const se::CheckpointRankPart& part : m->ranks)
    ::unlink((tag_dir + "/" + part.file).c_str());
  ::unlink(out.c_str());
  return 0;
}
