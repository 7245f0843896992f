// PyStore (py_store.h): a torch.distributed Store as the engine's rendezvous store.
#include "py_store.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace strata_py {

PyStore::~PyStore() {
  py::gil_scoped_acquire gil;
  store_ = py::object();
}

strata::Status PyStore::Set(const std::string& key, const std::vector<uint8_t>& value) {
  py::gil_scoped_acquire gil;
  try {
    store_.attr("set")(key, py::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
    return strata::Status::Ok();
  } catch (py::error_already_set& e) {
    return strata::UnavailableError("torch.distributed store set(" + key + "): " + e.what());
  }
}

strata::Result<std::vector<uint8_t>> PyStore::Get(const std::string& key,
                                                  std::chrono::milliseconds timeout) {
  STRATA_RETURN_IF_ERROR(Wait({key}, timeout));
  py::gil_scoped_acquire gil;
  try {
    std::string v = store_.attr("get")(key).cast<py::bytes>();
    return std::vector<uint8_t>(v.begin(), v.end());
  } catch (py::error_already_set& e) {
    return strata::UnavailableError("torch.distributed store get(" + key + "): " + e.what());
  }
}

strata::Result<int64_t> PyStore::Add(const std::string& key, int64_t delta) {
  py::gil_scoped_acquire gil;
  try {
    return store_.attr("add")(key, delta).cast<int64_t>();
  } catch (py::error_already_set& e) {
    return strata::UnavailableError("torch.distributed store add(" + key + "): " + e.what());
  }
}

strata::Status PyStore::Wait(const std::vector<std::string>& keys,
                             std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  try {
    store_.attr("wait")(keys, timeout);
    return strata::Status::Ok();
  } catch (py::error_already_set& e) {
    std::string names;
    for (const std::string& k : keys)
      names += (names.empty() ? "" : ", ") + k;
    return strata::DeadlineExceededError("torch.distributed store wait(" + names +
                                         "): " + e.what());
  }
}

}  // namespace strata_py
