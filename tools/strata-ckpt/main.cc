// strata-ckpt: inspect, verify and export Strata checkpoints (engine/checkpoint/checkpoint.h,
// docs/checkpoints.md).
//
//   strata-ckpt info DIR [--tag TAG]
//   strata-ckpt verify DIR [--tag TAG]
//   strata-ckpt export DIR [--tag TAG] --safetensors OUT [--dtype bf16|fp16|fp32]
//   strata-ckpt export DIR [--tag TAG] --hf OUTDIR --config CONFIG.json [--dtype D]
//                      [--max-shard-size 5GB]
//   strata-ckpt check-base DIR [--tag TAG] --safetensors BASE
//
// DIR is a save directory (its `latest` names the tag unless --tag is given) or a tag
// directory itself. Exit status: 0 ok, 1 a check or the export failed, 2 bad usage.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/layout/dtype.h"
#include "strata_generated/version.h"

namespace {

using strata::engine::CheckpointManifest;
using strata::engine::CheckpointTensor;

constexpr int kOk = 0, kFailed = 1, kUsage = 2;

// "bf16" -> "BF16" (the safetensors name), "" for anything but bf16, fp16, fp32.
std::string SafetensorsDTypeOf(const std::string& dtype) {
  return dtype == "fp32" ? "F32" : dtype == "bf16" ? "BF16" : dtype == "fp16" ? "F16" : "";
}

strata::Result<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return strata::NotFoundError("cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return strata::IOError("reading " + path);
  return text.str();
}

int Usage(const std::string& message) {
  std::fprintf(stderr, "strata-ckpt: %s\n(see strata-ckpt --help)\n", message.c_str());
  return kUsage;
}

void Help() {
  std::printf(
      "usage: strata-ckpt info DIR [--tag TAG]\n"
      "       strata-ckpt verify DIR [--tag TAG]\n"
      "       strata-ckpt export DIR [--tag TAG] --safetensors OUT [--dtype bf16|fp16|fp32]\n"
      "       strata-ckpt export DIR [--tag TAG] --hf OUTDIR --config CONFIG.json\n"
      "                          [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]\n"
      "       strata-ckpt check-base DIR [--tag TAG] --safetensors BASE\n"
      "\n"
      "Inspects, verifies and exports checkpoints written by save_checkpoint (C++, Python) or\n"
      "strata-train --save-dir. DIR is a save directory (its 'latest' file names the tag\n"
      "unless --tag is given) or one tag's directory.\n"
      "\n"
      "  info    the save directory's tags, then the tag's world size, step, precision,\n"
      "          parameters, groups and files\n"
      "  verify  reads every tensor of every rank's file against its CRC32C\n"
      "  export  writes the model (trained parameters consolidated from every rank, frozen\n"
      "          ones unless saved without them) as one safetensors file, names as the\n"
      "          model's named_parameters(), floating-point values in --dtype (default\n"
      "          fp32); streamed, and prints its peak memory. With --hf: the Hugging Face\n"
      "          layout in OUTDIR (model.safetensors, or shards of at most --max-shard-size\n"
      "          with model.safetensors.index.json, default 5GB), values in --dtype (default\n"
      "          the checkpoint's working dtype), the model's CONFIG.json copied as\n"
      "          config.json with its dtype set (and the generation_config.json beside it,\n"
      "          if any): AutoModel*.from_pretrained(OUTDIR) loads it\n"
      "  check-base  for a checkpoint saved without its frozen parameters: whether BASE (a\n"
      "          .safetensors file or an index JSON) holds the base it was trained on, by\n"
      "          the manifest's fingerprint of each frozen group (exit 0: every one matches)\n"
      "\n"
      "exit status: 0 ok, 1 a check or the export failed, 2 bad usage.\n");
}

std::string Bytes(uint64_t n) {
  return strata::FormatBytes(n);
}

double PeakRssMiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// DIR and --tag -> the tag directory, and the save directory's tags for `info`.
strata::Result<std::string> TagDir(const std::string& dir, const std::string& tag) {
  if (tag.empty()) {
    FILE* f = std::fopen((dir + "/manifest.json").c_str(), "rb");
    if (f != nullptr) {  // DIR is a tag directory
      std::fclose(f);
      return dir;
    }
  }
  STRATA_ASSIGN_OR_RETURN(std::string t, strata::engine::ResolveCheckpointTag(dir, tag));
  return dir + "/" + t;
}

// The manifest of DIR's tag (TagDir), and that tag's directory.
strata::Result<CheckpointManifest> OpenManifest(const std::string& dir, const std::string& tag,
                                                std::string* tag_dir) {
  STRATA_ASSIGN_OR_RETURN(*tag_dir, TagDir(dir, tag));
  return strata::engine::ReadCheckpointManifest(*tag_dir);
}

void PrintInfo(const std::string& tag_dir, const CheckpointManifest& m) {
  uint64_t params = 0, frozen = 0, groups_params = 0, trained_groups = 0;
  for (const auto& g : m.groups) {
    for (const auto& p : g.params) {
      if (g.frozen) {
        ++frozen;  // a frozen group's tensor
      } else {
        params += p.numel;
      }
    }
    if (!g.frozen) {
      groups_params += g.params.size();
      ++trained_groups;
    }
  }
  for (const auto& t : m.ranks[0].tensors)
    if (t.name.rfind("blob:shared:module:", 0) == 0) ++frozen;
  std::printf("checkpoint %s\n", tag_dir.c_str());
  std::printf("  format version   %d\n", m.version);
  std::printf("  tag              %s\n", m.tag.c_str());
  std::printf("  world size       %d\n", m.world_size);
  std::printf("  global steps     %" PRId64 " (optimizer steps %" PRId64 ", micro-steps %" PRId64
              ")\n",
              m.global_steps, m.adam_step, m.micro_steps);
  std::printf(
      "  precision        %s%s\n", m.dtype.c_str(),
      m.loss_scaler_enabled ? (", loss scale " + std::to_string(m.loss_scale)).c_str() : "");
  std::printf("  parameters       %" PRIu64 " trained in %zu groups (%" PRIu64 " tensors), %" PRIu64
              " frozen tensors\n",
              params, static_cast<size_t>(trained_groups), groups_params, frozen);
  if (m.partition_numel > m.trainable_numel) {
    const CheckpointTensor* t = m.ranks[0].Find("frozen");
    if (!m.frozen_saved) {
      size_t fingerprinted = 0, frozen_groups = 0;
      for (const auto& g : m.groups) {
        frozen_groups += g.frozen ? 1 : 0;
        fingerprinted += g.has_fingerprint ? 1 : 0;
      }
      std::printf(
          "  frozen values    not saved (exclude_frozen_parameters): a load keeps the model's\n");
      if (fingerprinted == 0) {
        std::printf(
            "                   (no fingerprints: saved by an older build, the model's "
            "base is not checked)\n");
      } else {
        std::printf(
            "                   and checks it against the fingerprints of %zu of %zu "
            "frozen groups\n",
            fingerprinted, frozen_groups);
      }
    } else if (m.frozen_in_master()) {
      std::printf("  frozen values    in fp32_master, as fp32 (format 1)\n");
    } else if (t != nullptr) {
      std::printf("  frozen values    %s, the working dtype (%" PRIu64 " elements per rank)\n",
                  t->dtype.c_str(), t->numel);
    }
  }
  std::printf("  size             %s in %zu rank files\n", Bytes(m.total_bytes()).c_str(),
              m.ranks.size());
  for (const auto& r : m.ranks) {
    std::printf("    %s  %s, %zu tensors\n", r.file.c_str(), Bytes(r.file_bytes).c_str(),
                r.tensors.size());
  }
}

int Info(const std::string& dir, const std::string& tag) {
  strata::Result<std::vector<strata::engine::CheckpointTagEntry>> tags =
      strata::engine::ListCheckpointTags(dir);
  if (tags.ok() && !tags->empty()) {
    strata::Result<std::string> latest = strata::engine::ResolveCheckpointTag(dir, "");
    std::printf("save directory %s\n", dir.c_str());
    for (const auto& e : *tags) {
      std::printf("  %-24s %s%s\n", e.name.c_str(),
                  e.complete ? "complete" : "incomplete (a save in progress or interrupted)",
                  latest.ok() && *latest == e.name ? "  <- latest" : "");
    }
  }
  std::string tag_dir;
  strata::Result<CheckpointManifest> m = OpenManifest(dir, tag, &tag_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "strata-ckpt: %s\n", m.status().ToString().c_str());
    return kFailed;
  }
  PrintInfo(tag_dir, *m);
  return kOk;
}

int Verify(const std::string& dir, const std::string& tag) {
  std::string tag_dir;
  strata::Result<CheckpointManifest> m = OpenManifest(dir, tag, &tag_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "strata-ckpt: %s\n", m.status().ToString().c_str());
    return kFailed;
  }
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0, bad = 0, count = 0;
  for (const auto& part : m->ranks) {
    for (const auto& t : part.tensors) {
      ++count;
      strata::Status s = strata::engine::VerifyCheckpointTensor(tag_dir, *m, part, t);
      if (!s.ok()) {
        ++bad;
        std::printf("BAD  %s\n", s.ToString().c_str());
      } else {
        bytes += t.bytes;
      }
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "%s: %" PRIu64 " of %" PRIu64 " tensors ok (%s read in %.2f s, %s/s)\n", tag_dir.c_str(),
      count - bad, count, Bytes(bytes).c_str(), secs,
      Bytes(static_cast<uint64_t>(static_cast<double>(bytes) / std::max(secs, 1e-9))).c_str());
  return bad == 0 ? kOk : kFailed;
}

int Export(const std::string& dir, const std::string& tag, const std::string& out,
           const std::string& dtype) {
  std::string tag_dir;
  strata::Result<CheckpointManifest> m = OpenManifest(dir, tag, &tag_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "strata-ckpt: %s\n", m.status().ToString().c_str());
    return kFailed;
  }
  const double rss_before = PeakRssMiB();
  const auto t0 = std::chrono::steady_clock::now();
  strata::Result<strata::engine::CheckpointExportStats> st =
      strata::engine::ExportCheckpointSafetensors(tag_dir, *m, out, dtype);
  if (!st.ok()) {
    std::fprintf(stderr, "strata-ckpt: export: %s\n", st.status().ToString().c_str());
    return kFailed;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: %" PRIu64 " tensors, %s, %s, in %.2f s\n", out.c_str(), st->tensors,
              dtype.c_str(), Bytes(st->bytes_written).c_str(), secs);
  std::printf("peak memory %.1f MiB (%.1f MiB before the export; largest tensor %s)\n",
              PeakRssMiB(), rss_before, Bytes(st->largest_tensor_bytes).c_str());
  if (st->frozen_left_out > 0) {
    std::printf("left out %" PRIu64
                " frozen parameters: the checkpoint was saved without them "
                "(exclude_frozen_parameters)\n",
                st->frozen_left_out);
  }
  return kOk;
}

// The fingerprint of `base`'s values for a frozen group's parameters (by name), each value
// rounded to `as` first; problems: what keeps it from being computed.
uint64_t BaseFingerprint(strata::engine::SafetensorsReader& base,
                         const strata::engine::CheckpointGroup& g, strata::engine::DType as,
                         std::vector<std::string>& problems) {
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<float> values;
  uint64_t sum = 0;
  for (const auto& p : g.params) {
    // A LibTorch strata::zero3 holder's parameters carry its ".inner."; a base file may not.
    std::string name = p.name;
    const strata::engine::SafetensorsTensor* t = base.Find(name);
    for (size_t at; t == nullptr && (at = name.find(".inner.")) != std::string::npos;) {
      name.erase(at, 6);
      t = base.Find(name);
    }
    if (t == nullptr) {
      problems.push_back(p.name + " is not in the base");
      continue;
    }
    if (t->numel != p.numel || !strata::engine::SafetensorsReader::IsFloatDType(t->dtype)) {
      problems.push_back(p.name + " is " + t->dtype + " of " + std::to_string(t->numel) +
                         " elements in the base, " + std::to_string(p.numel) +
                         " floating-point elements in the checkpoint");
      continue;
    }
    for (uint64_t first = 0; first < p.numel; first += kPiece) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, p.numel - first));
      values.resize(n);
      const strata::Status read = base.ReadFloat(name, first, values);
      if (!read.ok()) {
        problems.push_back(read.ToString());
        break;
      }
      // The values as the checkpoint's dtype holds them.
      sum += strata::engine::FrozenFingerprintSum(values, p.offset + first, as);
    }
  }
  return sum;
}

int CheckBase(const std::string& dir, const std::string& tag, const std::string& base_path) {
  using strata::engine::DType;
  std::string tag_dir;
  strata::Result<CheckpointManifest> m = OpenManifest(dir, tag, &tag_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "strata-ckpt: %s\n", m.status().ToString().c_str());
    return kFailed;
  }
  size_t fingerprinted = 0;
  for (const auto& g : m->groups)
    fingerprinted += g.has_fingerprint ? 1 : 0;
  if (m->frozen_saved || fingerprinted == 0) {
    std::fprintf(stderr, "strata-ckpt: check-base: %s %s\n", tag_dir.c_str(),
                 m->frozen_saved ? "holds its frozen values: it needs no base"
                                 : "has no frozen fingerprints (saved by an older build, or "
                                   "without frozen parameters): nothing to check");
    return kFailed;
  }
  const DType as = m->working_dtype;
  strata::Result<std::unique_ptr<strata::engine::SafetensorsReader>> base =
      strata::engine::SafetensorsReader::Open(base_path);
  if (!base.ok()) {
    std::fprintf(stderr, "strata-ckpt: check-base: %s\n", base.status().ToString().c_str());
    return kFailed;
  }
  std::printf("checkpoint %s (%s): %zu frozen groups fingerprinted; base %s\n", tag_dir.c_str(),
              m->dtype.c_str(), fingerprinted, base_path.c_str());
  size_t matched = 0, differ = 0;
  for (const auto& g : m->groups) {
    if (!g.has_fingerprint) continue;
    std::vector<std::string> problems;
    const uint64_t sum = BaseFingerprint(**base, g, as, problems);
    uint64_t numel = 0;
    for (const auto& p : g.params)
      numel += p.numel;
    const char* verdict = !problems.empty()             ? "CANNOT CHECK"
                          : sum == g.frozen_fingerprint ? "matches"
                                                        : "DIFFERS";
    matched += problems.empty() && sum == g.frozen_fingerprint ? 1 : 0;
    differ += problems.empty() && sum != g.frozen_fingerprint ? 1 : 0;
    std::printf("  %-32s %zu parameters, %" PRIu64 " elements  %s\n", g.name.c_str(),
                g.params.size(), numel, verdict);
    for (const std::string& why : problems)
      std::printf("      %s\n", why.c_str());
  }
  if (matched == fingerprinted) {
    std::printf("the base matches all %zu frozen groups: load the checkpoint onto it\n", matched);
    return kOk;
  }
  if (differ > 0) {
    std::printf(
        "%zu of %zu frozen groups differ: this is not the base the checkpoint was "
        "trained on\n",
        differ, fingerprinted);
  }
  if (fingerprinted - matched - differ > 0) {
    std::printf(
        "%zu of %zu frozen groups cannot be checked: the base lacks parameters of "
        "theirs, or holds them in another size (above)\n",
        fingerprinted - matched - differ, fingerprinted);
  }
  return kFailed;
}

// The --hf export: the model's config.json (its dtype set to the export's) and the
// generation_config.json beside it, written with the weights.
int ExportHf(const std::string& dir, const std::string& tag, const std::string& out_dir,
             const std::string& config_path, const std::string& dtype_arg,
             const std::string& max_size) {
  std::string tag_dir;
  strata::Result<CheckpointManifest> m = OpenManifest(dir, tag, &tag_dir);
  if (!m.ok()) {
    std::fprintf(stderr, "strata-ckpt: %s\n", m.status().ToString().c_str());
    return kFailed;
  }
  const std::string dtype = dtype_arg.empty() ? m->dtype : dtype_arg;
  const std::string st_dtype = SafetensorsDTypeOf(dtype);
  if (st_dtype.empty()) return Usage("--dtype " + dtype + ": one of bf16, fp16, fp32");
  strata::Result<uint64_t> limit = strata::ParseBytes(max_size);
  if (!limit.ok() || *limit == 0) {
    return Usage("--max-shard-size " + max_size + ": a positive size such as 5GB or 500MiB");
  }
  std::vector<std::pair<std::string, std::string>> files;
  strata::Result<std::string> config_text = ReadTextFile(config_path);
  if (!config_text.ok()) {
    std::fprintf(stderr, "strata-ckpt: export --hf: %s\n", config_text.status().ToString().c_str());
    return kFailed;
  }
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(*config_text, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) {
    std::fprintf(stderr,
                 "strata-ckpt: export --hf: %s is not a JSON object (a model's config.json)\n",
                 config_path.c_str());
    return kFailed;
  }
  const char* torch_name = dtype == "bf16" ? "bfloat16" : dtype == "fp16" ? "float16" : "float32";
  config["dtype"] = torch_name;
  if (config.contains("torch_dtype")) config["torch_dtype"] = torch_name;
  files.emplace_back("config.json", config.dump(2) + "\n");
  const size_t slash = config_path.find_last_of('/');
  const std::string gen_path =
      (slash == std::string::npos ? std::string() : config_path.substr(0, slash + 1)) +
      "generation_config.json";
  if (::access(gen_path.c_str(), R_OK) == 0) {
    strata::Result<std::string> gen = ReadTextFile(gen_path);
    if (!gen.ok()) {
      std::fprintf(stderr, "strata-ckpt: export --hf: %s\n", gen.status().ToString().c_str());
      return kFailed;
    }
    files.emplace_back("generation_config.json", *gen);
  }
  const double rss_before = PeakRssMiB();
  const auto t0 = std::chrono::steady_clock::now();
  strata::Result<strata::engine::CheckpointModelExportStats> st =
      strata::engine::ExportCheckpointModel(tag_dir, *m, out_dir, st_dtype, *limit, files);
  if (!st.ok()) {
    std::fprintf(stderr, "strata-ckpt: export: %s\n", st.status().ToString().c_str());
    return kFailed;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string index = st->files.index.empty() ? "" : " with " + st->files.index;
  std::printf("wrote %s: %" PRIu64 " tensors in %zu file(s)%s, %s, %s, in %.2f s\n",
              out_dir.c_str(), st->base.tensors, st->files.files.size(), index.c_str(),
              dtype.c_str(), Bytes(st->base.bytes_written).c_str(), secs);
  std::printf("peak memory %.1f MiB (%.1f MiB before the export; largest tensor %s)\n",
              PeakRssMiB(), rss_before, Bytes(st->base.largest_tensor_bytes).c_str());
  if (st->base.frozen_left_out > 0) {
    std::printf("left out %" PRIu64
                " frozen parameters: the checkpoint was saved without them "
                "(exclude_frozen_parameters)\n",
                st->base.frozen_left_out);
  }
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return Usage("a command is needed: info, verify, export or check-base");
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    Help();
    return kOk;
  }
  if (args[0] == "--version") {
    std::printf("strata-ckpt %s\n", STRATA_VERSION_STRING);
    return kOk;
  }
  const std::string cmd = args[0];
  if (cmd != "info" && cmd != "verify" && cmd != "export" && cmd != "check-base") {
    return Usage("unknown command '" + cmd + "' (info, verify, export or check-base)");
  }
  std::string dir, tag, out, dtype, hf, config, max_size = "5GB";
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](std::string& into) {
      if (i + 1 >= args.size()) return false;
      into = args[++i];
      return true;
    };
    if (a == "--tag") {
      if (!value(tag)) return Usage("--tag needs a value");
    } else if (a == "--safetensors" && (cmd == "export" || cmd == "check-base")) {
      if (!value(out)) return Usage("--safetensors needs a file name");
    } else if (a == "--dtype" && cmd == "export") {
      if (!value(dtype)) return Usage("--dtype needs a value");
    } else if (a == "--hf" && cmd == "export") {
      if (!value(hf)) return Usage("--hf needs a directory");
    } else if (a == "--config" && cmd == "export") {
      if (!value(config)) return Usage("--config needs the model's config.json");
    } else if (a == "--max-shard-size" && cmd == "export") {
      if (!value(max_size)) return Usage("--max-shard-size needs a size");
    } else if (!a.empty() && a[0] == '-') {
      return Usage("unknown option '" + a + "' for " + cmd);
    } else if (dir.empty()) {
      dir = a;
    } else {
      return Usage("one directory only ('" + dir + "', then '" + a + "')");
    }
  }
  if (dir.empty()) return Usage(cmd + " needs a checkpoint directory");
  if (cmd == "info") return Info(dir, tag);
  if (cmd == "verify") return Verify(dir, tag);
  if (cmd == "check-base") {
    if (out.empty()) return Usage("check-base needs --safetensors BASE");
    return CheckBase(dir, tag, out);
  }
  if (!hf.empty()) {
    if (!out.empty()) return Usage("export takes --safetensors OUT or --hf OUTDIR, not both");
    if (config.empty()) {
      return Usage("export --hf needs --config CONFIG.json (the model's Hugging Face config)");
    }
    return ExportHf(dir, tag, hf, config, dtype, max_size);
  }
  if (!config.empty() || max_size != "5GB") {
    return Usage("--config and --max-shard-size go with --hf");
  }
  if (out.empty()) return Usage("export needs --safetensors OUT or --hf OUTDIR");
  if (dtype.empty()) dtype = "fp32";
  const std::string st_dtype = SafetensorsDTypeOf(dtype);
  if (st_dtype.empty()) return Usage("--dtype " + dtype + ": one of bf16, fp16, fp32");
  return Export(dir, tag, out, st_dtype);
}
