#include "strata/comm/communicator.h"

#include <algorithm>
#include <string>

#include "strata/comm/common.h"
#include "strata/comm/gloo_communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/check.h"

#if defined(STRATA_HAVE_CUDA)
#include "strata/comm/nccl_backend.h"
#endif

namespace strata::comm {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kInt64:
      return 8;
  }
  STRATA_CHECK(false) << "bad dtype " << static_cast<int>(dtype);
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "float") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return DType::kFloat16;
  if (name == "int64" || name == "long") return DType::kInt64;
  return InvalidArgumentError("unknown dtype '" + std::string(name) +
                              "' (expected fp32, bf16, fp16 or int64)");
}

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "unknown";
}

std::string_view BackendName(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

Result<Backend> ParseBackend(std::string_view name) {
  if (name == "gloo") return Backend::kGloo;
  if (name == "nccl") return Backend::kNccl;
  return InvalidArgumentError("unknown communication backend '" + std::string(name) +
                              "' (expected gloo or nccl)");
}

Shard Partition(size_t total, int world_size, int rank) {
  STRATA_CHECK(world_size >= 1 && rank >= 0 && rank < world_size)
      << "Partition(total=" << total << ", world_size=" << world_size << ", rank=" << rank << ")";
  const size_t w = static_cast<size_t>(world_size);
  const size_t r = static_cast<size_t>(rank);
  const size_t base = total / w;
  const size_t extra = total % w;
  return Shard{r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

Result<std::unique_ptr<Communicator>> Communicator::Duplicate() const {
  Result<std::unique_ptr<Communicator>> dup = DuplicateImpl();
  if (!dup.ok()) {
    return dup.status().WithContext(
        "duplicating the communicator (every rank must call Duplicate, in the same order)");
  }
  return dup;
}

Result<std::unique_ptr<Communicator>> Communicator::DuplicateImpl() const {
  return UnimplementedError(std::string(BackendName(backend())) + " communicator of rank " +
                            std::to_string(rank()) + " of " + std::to_string(world_size()) +
                            ": this implementation cannot duplicate itself (create a second "
                            "communicator over the same ranks instead)");
}

Result<std::unique_ptr<Communicator>> CreateCommunicator(Backend backend,
                                                         const Rendezvous& rendezvous,
                                                         const CommOptions& options) {
  STRATA_RETURN_IF_ERROR(internal::ValidateOptions(options));
  if (rendezvous.world_size < 1 || rendezvous.rank < 0 ||
      rendezvous.rank >= rendezvous.world_size) {
    return InvalidArgumentError("CreateCommunicator: bad rendezvous: rank " +
                                std::to_string(rendezvous.rank) + " of world size " +
                                std::to_string(rendezvous.world_size));
  }
  if (rendezvous.world_size > 1 && rendezvous.store == nullptr) {
    return InvalidArgumentError("CreateCommunicator: the rendezvous has no store (world size " +
                                std::to_string(rendezvous.world_size) + ")");
  }
  switch (backend) {
    case Backend::kGloo:
      return internal::CreateGlooCommunicator(rendezvous, options);
    case Backend::kNccl:
#if defined(STRATA_HAVE_CUDA)
      return internal::CreateNcclCommunicator(rendezvous, options);
#else
      return UnimplementedError(
          "the NCCL backend is not available: Strata was built without CUDA (configure with "
          "the CUDA toolkit installed, STRATA_CUDA=AUTO or ON)");
#endif
  }
  return InvalidArgumentError("CreateCommunicator: unknown backend " +
                              std::to_string(static_cast<int>(backend)));
}

}  // namespace strata::comm
