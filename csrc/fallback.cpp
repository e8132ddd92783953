// CompositeExplicitAutograd kernels of the effmem ops: what the dispatcher
// runs when no CPU or CUDA kernel applies. That is a call with no tensor at
// all (empty lists: the op's empty result, where the dispatcher would find no
// kernel), or tensors of another layout or device (sparse, MPS...): the same
// argument checks as the device kernels, so the user gets their message, and
// otherwise an error naming the device.
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/linear_ce.h"

namespace effmem {
namespace {

[[noreturn]] void no_kernel(const char* op, const at::Tensor& t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "effmem::", op, " has CPU and CUDA kernels only, got ", describe(t));
}

void adam_step_fallback(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps, double lr,
                        double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                        bool bias_correction, const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& status) {
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay,
                  lr_tensor, inv_scale, found_inf, status);
  if (params.empty()) return;
  no_kernel("adam_step_", params[0]);
}

void adam8_step_fallback(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList exp_avg_scales,
                         at::TensorList exp_avg_sq_scales, at::TensorList masters, at::TensorList steps,
                         at::IntArrayRef salts, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool, bool, const std::optional<at::Tensor>& lr_tensor,
                         const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& status) {
  const Adam8State eight{exp_avg_scales, exp_avg_sq_scales, salts};
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay,
                  lr_tensor, inv_scale, found_inf, status, &eight);
  if (params.empty()) return;
  no_kernel("adam8_step_", params[0]);
}

// adam_check's only kernel, for every device: the checks alone, with hyper-parameters they accept (FusedAdam
// checks its groups' own before).
void adam_check(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList masters, at::TensorList steps, at::TensorList exp_avg_scales,
                at::TensorList exp_avg_sq_scales) {
  const std::vector<int64_t> salts(params.size(), 0);
  const Adam8State eight{exp_avg_scales, exp_avg_sq_scales, salts};
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, 0.0, 0.9, 0.999, 1e-8, 0.0, std::nullopt,
                  std::nullopt, std::nullopt, std::nullopt,
                  exp_avg_scales.empty() && exp_avg_sq_scales.empty() ? nullptr : &eight);   // half: refused
}

// The checkpoint conversions run on the CPU (python/effmem/optim/_adam8.py converts elsewhere in torch ops).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> adam8_encode_fallback(const at::Tensor& m,
                                                                                 const at::Tensor&, double, int64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "effmem::adam8_encode has a CPU kernel only, got ", describe(m));
}

at::Tensor adam8_decode_fallback(const at::Tensor& codes, const at::Tensor&, bool) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "effmem::adam8_decode has a CPU kernel only, got ", describe(codes));
}

at::Tensor l2norm_fallback(at::TensorList tensors) {
  check_norm_args(tensors);
  if (tensors.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
  no_kernel("l2norm", tensors[0]);
}

std::tuple<at::Tensor, at::Tensor> quantize_fallback(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                     int64_t, bool) {
  check_quantize_args(x, bits, group_size);
  no_kernel("quantize", x);
}

at::Tensor dequantize_fallback(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                               int64_t last_dim, at::ScalarType dtype) {
  check_dequantize_args(codes, stats, bits, group_size, last_dim, dtype);
  no_kernel("dequantize", codes);
}

std::tuple<at::Tensor, at::Tensor> linear_ce_forward_fallback(const at::Tensor& hidden, const at::Tensor& weight,
                                                              const std::optional<at::Tensor>& bias,
                                                              const at::Tensor& target, int64_t, double smoothing,
                                                              double softcap, int64_t) {
  check_linear_ce_args(hidden, weight, bias, target, smoothing, softcap);   // a sparse bias or target: named
  no_kernel("linear_ce_forward", hidden);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_ce_backward_fallback(
    const at::Tensor&, const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const at::Tensor&, int64_t, double smoothing, double softcap, int64_t,
    std::array<bool, 3>) {
  check_linear_ce_args(hidden, weight, bias, target, smoothing, softcap);
  no_kernel("linear_ce_backward", hidden);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ce_forward_backward_fallback(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const at::Tensor&, int64_t, double smoothing, double softcap, int64_t,
    std::array<bool, 3>) {
  check_linear_ce_args(hidden, weight, bias, target, smoothing, softcap);
  no_kernel("linear_ce_forward_backward", hidden);
}

at::Tensor swiglu_fallback(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu_args(nullptr, gate, up);
  no_kernel("swiglu", gate);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_fallback(const at::Tensor& grad, const at::Tensor& gate,
                                                            const at::Tensor& up) {
  check_swiglu_args(&grad, gate, up);
  no_kernel("swiglu_backward", gate);
}

at::Tensor rms_norm_apply_fallback(const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& weight) {
  check_rms_norm_apply_args(x, rstd, weight);
  no_kernel("rms_norm_apply", x);
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CompositeExplicitAutograd, m) {
  m.impl("adam_step_", &adam_step_fallback);
  m.impl("adam8_step_", &adam8_step_fallback);
  m.impl("adam_check", &adam_check);
  m.impl("adam8_encode", &adam8_encode_fallback);
  m.impl("adam8_decode", &adam8_decode_fallback);
  m.impl("l2norm", &l2norm_fallback);
  m.impl("quantize", &quantize_fallback);
  m.impl("dequantize", &dequantize_fallback);
  m.impl("linear_ce_forward", &linear_ce_forward_fallback);
  m.impl("linear_ce_backward", &linear_ce_backward_fallback);
  m.impl("linear_ce_forward_backward", &linear_ce_forward_backward_fallback);
  m.impl("swiglu", &swiglu_fallback);
  m.impl("swiglu_backward", &swiglu_backward_fallback);
  m.impl("rms_norm_apply", &rms_norm_apply_fallback);
}

// Autograd: the ops below have no derivative. effmem's own callers detach their inputs or run them inside
// autograd Functions that own the math; a user calling one on a tensor that requires grad got, from torch's
// deprecated fallback, a warning and outputs whose backward silently gave no gradient. torch's not-implemented
// kernel makes a backward through them raise, naming the op. (linear_ce_forward's autograd is linear_ce.py's;
// the in-place Adam steps run under no_grad.)
TORCH_LIBRARY_IMPL(effmem, Autograd, m) {
  for (const char* op : {"adam8_encode", "adam8_decode", "l2norm", "quantize", "dequantize", "linear_ce_backward",
                         "linear_ce_forward_backward", "swiglu", "swiglu_backward", "rms_norm_apply"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

// The Adam steps write their parameters (and state) in place, and as after torch's in-place ops each written
// tensor's version counter moves: a graph that saved a parameter before the step refuses a backward after it
// ("modified by an inplace operation") where it gave a gradient of the old value, silently. Their Autograd
// kernel (they have no derivative), below which torch's fallbacks skip the ADInplaceOrView key, and bump
// single tensors only where these write lists.
static void bump_written(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() == nullptr || !args[i].alias_info()->isWrite()) continue;
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      written.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) written.push_back(t);
    }
  }
  // torch refuses an in-place write to a leaf that requires grad under grad mode (its gradient would be of a
  // value no longer there); a direct call of the op went through (FusedAdam steps under torch.no_grad())
  for (const at::Tensor& t : written) {
    TORCH_CHECK(!(at::GradMode::is_enabled() && t.defined() && t.requires_grad() && t.is_leaf()), op.schema().name(),
                ": writes a leaf tensor that requires grad in place; call it under torch.no_grad(), as torch's "
                "optimizers step");
  }
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

TORCH_LIBRARY_IMPL(effmem, Autograd, m) {
  for (const char* op : {"adam_step_", "adam8_step_"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written>());
  }
}

}  // namespace effmem
