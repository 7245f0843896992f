// strata-ckpt export: a checkpoint as one safetensors file (checkpoint.h).
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>

#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/file_read.h"
#include "strata/engine/checkpoint/files.h"
#include "strata/engine/checkpoint/format.h"
#include "strata/engine/checkpoint/model_writer.h"

namespace strata::engine {
namespace {

// A tensor of the exported file and where its values come from.
struct ExportItem {
  std::string name;
  std::string dtype;  // in the file
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  uint64_t bytes = 0;
  // A trained parameter: group and parameter index; a frozen one: its blob.
  size_t group = 0, param = 0;
  const CheckpointTensor* blob = nullptr;
};

// The export of one checkpoint: its tensors in order, read from the ranks' files (each opened
// once) and written converted_.
class Exporter {
 public:
  Exporter(const std::string& tag_dir, const CheckpointManifest& m, DType out_type)
      : tag_dir_(tag_dir), m_(m), out_type_(out_type) {
    uint64_t so = 0;
    for (const CheckpointGroup& g : m.groups) {
      shard_offset_.push_back(so);
      so += g.shard_numel;
    }
  }
  ~Exporter() {
    for (const auto& [q, fd] : fds_)
      ::close(fd);
  }
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  // Every trained parameter (and frozen one, unless the save left them out) and every
  // unmanaged parameter rank 0 kept, each named once; the CRC of every tensor read checked.
  Result<std::vector<ExportItem>> Items(const std::string& dtype, CheckpointExportStats& stats) {
    const CheckpointManifest& m = m_;
    const std::string& tag_dir = tag_dir_;
    const DType out_type = out_type_;
    std::vector<ExportItem> items;
    std::set<std::string> names;
    for (size_t g = 0; g < m.groups.size(); ++g) {
      if (m.groups[g].frozen && !m.frozen_saved) {
        stats.frozen_left_out += m.groups[g].params.size();
        continue;
      }
      for (size_t i = 0; i < m.groups[g].params.size(); ++i) {
        const CheckpointParam& p = m.groups[g].params[i];
        ExportItem it;
        it.name = p.name;
        it.dtype = dtype;
        it.shape = p.shape;
        it.numel = p.numel;
        it.bytes = p.numel * DTypeSize(out_type);
        it.group = g;
        it.param = i;
        items.push_back(std::move(it));
      }
    }
    const std::string frozen = std::string("blob:") + kSharedBlobPrefix + "module:";
    for (const CheckpointTensor& t : m.ranks[0].tensors) {
      if (t.name.rfind(frozen, 0) != 0) continue;
      ExportItem it;
      it.name = t.name.substr(frozen.size());
      it.dtype = IsFloatName(t.dtype) ? dtype : t.dtype;
      it.shape = t.shape;
      it.numel = t.numel;
      it.bytes = t.numel * CheckpointDTypeSize(it.dtype);
      it.blob = &t;
      items.push_back(std::move(it));
    }
    for (const ExportItem& it : items) {
      if (!names.insert(it.name).second) {
        return InvalidArgumentError("export: two tensors are named " + it.name);
      }
    }
    for (const CheckpointRankPart& part : m.ranks) {
      STRATA_RETURN_IF_ERROR(
          VerifyCheckpointTensor(tag_dir, m, part, *part.Find(kStateTensors[0])));
      if (const CheckpointTensor* t = part.Find(kFrozenTensor); t != nullptr) {
        STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *t));
      }
    }
    for (const ExportItem& it : items)
      if (it.blob != nullptr)
        STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, m.ranks[0], *it.blob));
    return items;
  }

  // Tensor `it`'s values, converted, appended to `w`.
  Status WriteItem(const ExportItem& it, FileWriter& w) {
    return WriteItem(it, [&w](const void* data, size_t bytes) { return w.Write(data, bytes); });
  }
  Status WriteItem(const ExportItem& it, const std::function<Status(const void*, size_t)>& write) {
    const CheckpointManifest& m = m_;
    const DType out_type = out_type_;
    for (uint64_t done = 0; done < it.numel;) {
      const uint64_t count = std::min<uint64_t>(kPieceFloats, it.numel - done);
      if (it.blob == nullptr) {
        values_.assign(count, 0.0f);
        const CheckpointGroup& g = m.groups[it.group];
        const uint64_t first = g.params[it.param].offset + done;
        for (uint64_t e = first; e < first + count;) {
          const uint64_t q = e / g.shard_numel;
          const uint64_t within = e - q * g.shard_numel;
          const uint64_t n = std::min(first + count - e, g.shard_numel - within);
          const CheckpointRankPart& part = m.ranks[q];
          STRATA_ASSIGN_OR_RETURN(const int fd, FdOf(static_cast<int>(q)));
          STRATA_RETURN_IF_ERROR(ReadSavedValues(
              fd, m, part, it.group, shard_offset_[it.group] + within, n,
              values_.data() + (e - first), raw_, "checkpoint " + m.tag + ", file " + part.file));
          e += n;
        }
      } else {
        const uint64_t esize = CheckpointDTypeSize(it.blob->dtype);
        raw_.resize(count * esize);
        STRATA_ASSIGN_OR_RETURN(const int fd, FdOf(0));
        STRATA_RETURN_IF_ERROR(ReadExactly(fd, raw_.data(), raw_.size(),
                                           it.blob->offset + done * esize,
                                           "checkpoint " + m.tag + ", file " + m.ranks[0].file));
        if (!IsFloatName(it.blob->dtype)) {
          STRATA_RETURN_IF_ERROR(write(raw_.data(), raw_.size()));
          done += count;
          continue;
        }
        values_.resize(count);
        ToFloat(raw_.data(), it.blob->dtype, count, values_.data());
      }
      converted_.resize(count * DTypeSize(out_type));
      ConvertFromFloat(values_.data(), count, converted_.data(), out_type);
      STRATA_RETURN_IF_ERROR(write(converted_.data(), converted_.size()));
      done += count;
    }
    return Status::Ok();
  }

 private:
  Result<int> FdOf(int q) {
    if (const auto f = fds_.find(q); f != fds_.end()) return f->second;
    const std::string path = tag_dir_ + "/" + m_.ranks[static_cast<size_t>(q)].file;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "opening " + path);
    fds_[q] = fd;
    return fd;
  }

  const std::string& tag_dir_;
  const CheckpointManifest& m_;
  const DType out_type_;
  std::vector<uint64_t> shard_offset_;
  std::map<int, int> fds_;
  std::vector<float> values_;
  std::vector<std::byte> raw_, converted_;
};

// The safetensors header: names, dtypes, shapes, offsets; padded with spaces to 8 bytes.
std::string ExportHeader(const CheckpointManifest& m, const std::vector<ExportItem>& items,
                         CheckpointExportStats& stats) {
  Json header = Json::object();
  header["__metadata__"] = {{"format", "pt"}, {"source", "strata checkpoint " + m.tag}};
  uint64_t at = 0;
  for (const ExportItem& it : items) {
    header[it.name] = {
        {"dtype", it.dtype}, {"shape", it.shape}, {"data_offsets", {at, at + it.bytes}}};
    at += it.bytes;
    stats.largest_tensor_bytes = std::max(stats.largest_tensor_bytes, it.bytes);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  stats.tensors = items.size();
  stats.bytes_written = 8 + text.size() + at;
  return text;
}

}  // namespace

Result<CheckpointExportStats> ExportCheckpointSafetensors(const std::string& tag_dir,
                                                          const CheckpointManifest& m,
                                                          const std::string& out,
                                                          const std::string& dtype) {
  const std::optional<DType> out_dtype = WorkingDTypeOfName(dtype);
  if (!out_dtype) {
    return InvalidArgumentError("export: dtype " + dtype + " (one of F32, BF16, F16)");
  }
  Exporter exporter(tag_dir, m, *out_dtype);
  CheckpointExportStats stats;
  STRATA_ASSIGN_OR_RETURN(const std::vector<ExportItem> items, exporter.Items(dtype, stats));
  const std::string text = ExportHeader(m, items, stats);
  // Into OUT.tmp, fsynced, then renamed: a failure leaves no half-written file as OUT.
  const std::string tmp = out + ".tmp";
  const Status written = [&]() -> Status {
    if (Exists(tmp) && ::unlink(tmp.c_str()) != 0) return ErrnoError(errno, "removing " + tmp);
    FileWriter w;
    STRATA_RETURN_IF_ERROR(w.Open(tmp));
    uint8_t size_le[8];
    for (int b = 0; b < 8; ++b)
      size_le[b] = static_cast<uint8_t>((text.size() >> (8 * b)) & 0xff);
    STRATA_RETURN_IF_ERROR(w.Write(size_le, 8));
    STRATA_RETURN_IF_ERROR(w.Write(text.data(), text.size()));
    for (const ExportItem& it : items)
      STRATA_RETURN_IF_ERROR(exporter.WriteItem(it, w));
    STRATA_RETURN_IF_ERROR(w.Sync());
    STRATA_RETURN_IF_ERROR(w.Close());
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + tmp + " to " + out);
    }
    return Status::Ok();
  }();
  if (!written.ok()) {
    ::unlink(tmp.c_str());
    return written;
  }
  return stats;
}

Result<CheckpointModelExportStats> ExportCheckpointModel(
    const std::string& tag_dir, const CheckpointManifest& m, const std::string& out_dir,
    const std::string& dtype, uint64_t max_file_bytes,
    const std::vector<std::pair<std::string, std::string>>& small_files) {
  const std::optional<DType> out_dtype = WorkingDTypeOfName(dtype);
  if (!out_dtype) {
    return InvalidArgumentError("export: dtype " + dtype + " (one of F32, BF16, F16)");
  }
  Exporter exporter(tag_dir, m, *out_dtype);
  CheckpointModelExportStats stats;
  STRATA_ASSIGN_OR_RETURN(const std::vector<ExportItem> items, exporter.Items(dtype, stats.base));
  std::vector<ModelTensorSpec> specs;
  for (const ExportItem& it : items) {
    std::vector<int64_t> shape(it.shape.begin(), it.shape.end());
    specs.push_back({it.name, it.dtype, shape});
    stats.base.largest_tensor_bytes = std::max(stats.base.largest_tensor_bytes, it.bytes);
  }
  stats.base.tensors = items.size();
  STRATA_RETURN_IF_ERROR(MakeDirs(out_dir));
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<ModelWriter> writer,
      ModelWriter::Create(out_dir, "model.safetensors", std::move(specs), max_file_bytes,
                          {{"source", "strata checkpoint " + m.tag}}));
  for (const ExportItem& it : items) {
    STRATA_RETURN_IF_ERROR(exporter.WriteItem(
        it, [&](const void* data, size_t bytes) { return writer->Append(data, bytes); }));
  }
  STRATA_ASSIGN_OR_RETURN(stats.files, writer->Commit(small_files));
  stats.base.bytes_written = stats.files.file_bytes;
  return stats;
}

}  // namespace strata::engine
