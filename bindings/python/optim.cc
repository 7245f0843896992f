// strata.optim's kernel: CPU Adam/AdamW (optim/cpu_adam) over raw data pointers that
// strata/optim.py takes from contiguous CPU tensors (data_ptr(), numel()).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "errors.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace py = pybind11;

namespace strata_py {

namespace {

strata::ScalarType ParseScalarType(const std::string& name) {
  if (name == "fp32") return strata::ScalarType::kFloat32;
  if (name == "bf16") return strata::ScalarType::kBFloat16;
  if (name == "fp16") return strata::ScalarType::kFloat16;
  ThrowValueError("gradient dtype must be fp32, bf16 or fp16, got " + name);
}

class AdamKernel {
 public:
  AdamKernel(int num_threads, const std::optional<std::string>& isa) {
    strata::CpuAdam::Options o;
    o.num_threads = num_threads;
    if (isa.has_value()) o.isa = ValueOrThrow(strata::ParseCpuIsa(*isa));
    adam_ = ValueOrThrow(strata::CpuAdam::Create(o));
  }

  std::string isa() const { return std::string(strata::CpuIsaName(adam_->isa())); }
  int num_threads() const { return adam_->num_threads(); }

  void Step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, size_t numel,
            const std::string& grad_dtype, int64_t step, double lr, double beta1, double beta2,
            double eps, double weight_decay, bool adamw_mode, bool bias_correction,
            float inv_loss_scale, float clip_coef, uintptr_t param16,
            const std::string& param16_dtype) const {
    strata::AdamParams p;
    p.lr = lr;
    p.beta1 = beta1;
    p.beta2 = beta2;
    p.eps = eps;
    p.weight_decay = weight_decay;
    p.weight_decay_mode =
        adamw_mode ? strata::WeightDecayMode::kDecoupled : strata::WeightDecayMode::kL2;
    p.bias_correction = bias_correction;
    strata::AdamTensors t;
    t.param = {reinterpret_cast<float*>(param), numel};
    t.exp_avg = {reinterpret_cast<float*>(exp_avg), numel};
    t.exp_avg_sq = {reinterpret_cast<float*>(exp_avg_sq), numel};
    t.grad = {reinterpret_cast<const void*>(grad), numel, ParseScalarType(grad_dtype)};
    if (param16 != 0) {
      const strata::ScalarType out = ParseScalarType(param16_dtype);
      if (out == strata::ScalarType::kFloat32) {
        ThrowValueError("param16_dtype must be bf16 or fp16, got " + param16_dtype);
      }
      t.param16 = {reinterpret_cast<uint16_t*>(param16), numel, out};
    }
    strata::Status s;
    {
      py::gil_scoped_release release;
      s = adam_->Step(p, step, {inv_loss_scale, clip_coef}, t);
    }
    Check(s);
  }

  // The read-only norm pass: (sum of (g * inv_loss_scale)^2, whether some g is inf/NaN).
  std::pair<double, bool> GradSquaredNorm(uintptr_t grad, size_t numel,
                                          const std::string& grad_dtype,
                                          float inv_loss_scale) const {
    const strata::GradSpan g{reinterpret_cast<const void*>(grad), numel,
                             ParseScalarType(grad_dtype)};
    strata::Result<strata::GradNorm> r = strata::GradNorm{};
    {
      py::gil_scoped_release release;
      r = adam_->GradSquaredNorm(g, inv_loss_scale);
    }
    const strata::GradNorm n = ValueOrThrow(std::move(r));
    return {n.sum_sq, n.has_inf_nan};
  }

 private:
  std::unique_ptr<strata::CpuAdam> adam_;
};

}  // namespace

void BindOptim(py::module_& m) {
  py::class_<AdamKernel>(m, "AdamKernel",
                         "The SIMD CPU Adam kernel (optim/cpu_adam) over raw addresses.")
      .def(py::init<int, const std::optional<std::string>&>(), py::arg("num_threads") = 0,
           py::arg("isa") = py::none())
      .def_property_readonly("isa", &AdamKernel::isa)
      .def_property_readonly("num_threads", &AdamKernel::num_threads)
      .def("step", &AdamKernel::Step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("numel"), py::arg("grad_dtype"), py::arg("step"),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"),
           py::arg("inv_loss_scale") = 1.0f, py::arg("clip_coef") = 1.0f, py::arg("param16") = 0,
           py::arg("param16_dtype") = "bf16",
           "One fused Adam step over numel fp32 elements at the given addresses: the gradient "
           "times inv_loss_scale * clip_coef, and (param16 != 0) the new parameters rounded "
           "to bf16 or fp16 at that address.")
      .def("grad_squared_norm", &AdamKernel::GradSquaredNorm, py::arg("grad"), py::arg("numel"),
           py::arg("grad_dtype"), py::arg("inv_loss_scale") = 1.0f,
           "The read-only norm pass: (sum of squares of grad * inv_loss_scale, inf/NaN seen).");
}

}  // namespace strata_py
