// CPU implementations of effmem::adam_step_ (float32 moments) and
// effmem::adam8_step_ (8-bit moments, common/adam8_math.h): each splits every
// tensor into spans of kAdamSpan elements and runs the vectorised kernel
// (cpu/kernels.inc) for the chosen ISA over them on the intra-op thread pool.
// effmem::adam8_encode / adam8_decode convert a checkpoint's moments the same way.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "common/adam8_math.h"
#include "common/adam_math.h"
#include "common/checks.h"
#include "common/thread_pool.h"
#include "cpu/dispatch.h"

namespace effmem::cpu {
namespace {

float scalar_value(const std::optional<at::Tensor>& t, float fallback) {
  return t.has_value() ? *t->data_ptr<float>() : fallback;
}

// What both ops do around the kernel: the checks, found_inf, the values read
// on the host, per-tensor coefficients; then span(i, begin, n, coeffs) makes
// each span's work item, and run(item) runs it on the pool.
template <class Item, class MakeItem, class Run>
void run_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList masters, at::TensorList steps, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool decoupled, bool bias_correction, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& status, const Adam8State* eight, MakeItem&& make_item, Run&& run) {
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                  weight_decay, lr_tensor, inv_scale, found_inf, status, eight);
  if (params.empty()) return;
  // A grad scaler found inf/nan in the gradients: skip the whole step.
  if (scalar_value(found_inf, 0.0f) != 0.0f) return;
  const double step_lr = lr_tensor.has_value() ? scalar_value(lr_tensor, 0.0f) : lr;
  // Host memory: the values are checked here, before anything is written.
  if (lr_tensor.has_value()) check_lr_value(step_lr, "lr_tensor");
  for (size_t i = 0; i < steps.size(); ++i) check_step_value(*steps[i].data_ptr<float>(), i);
  const double grad_scale = scalar_value(inv_scale, 1.0f);

  std::vector<AdamCoeffs> coeffs(params.size());
  std::vector<Item> work;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    if (numel == 0) continue;
    coeffs[i] = adam_coeffs(step_lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction,
                            *steps[i].data_ptr<float>(), grad_scale);
    for (int64_t begin = 0; begin < numel; begin += kAdamSpan) {
      work.push_back(make_item(i, begin, std::min(kAdamSpan, numel - begin), &coeffs[i]));
    }
  }
  intra_op_pool()->run(static_cast<int64_t>(work.size()), [&](int64_t k) { run(work[k]); });
}

template <class Span>
struct Work {
  Span span;
  int64_t n;
  const AdamCoeffs* coeffs;
};

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool decoupled, bool bias_correction, const std::optional<at::Tensor>& lr_tensor,
                   const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& status) {
  const bool low_precision = !masters.empty();
  AdamFn fn = nullptr;
  run_adam<Work<AdamSpan>>(
      params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay, decoupled,
      bias_correction, lr_tensor, inv_scale, found_inf, status, nullptr,
      [&](size_t i, int64_t begin, int64_t n, const AdamCoeffs* c) {
        if (fn == nullptr) {
          fn = kernels().adam[dtype_index(params[0].scalar_type(), "params")]
                             [dtype_index(grads[0].scalar_type(), "grads")];
        }
        char* p = static_cast<char*>(params[i].data_ptr());
        const char* g = static_cast<const char*>(grads[i].data_ptr());
        float* w = low_precision ? masters[i].data_ptr<float>() : params[i].data_ptr<float>();
        const AdamSpan span{p + begin * params[i].element_size(), g + begin * grads[i].element_size(), w + begin,
                            exp_avgs[i].data_ptr<float>() + begin, exp_avg_sqs[i].data_ptr<float>() + begin};
        return Work<AdamSpan>{span, n, c};
      },
      [&](const Work<AdamSpan>& item) { fn(item.span, item.n, *item.coeffs); });
}

void adam8_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                    at::TensorList masters, at::TensorList steps, at::IntArrayRef salts, double lr, double beta1,
                    double beta2, double eps, double weight_decay, bool decoupled, bool bias_correction,
                    const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& status) {
  const Adam8State eight{exp_avg_scales, exp_avg_sq_scales, salts};
  const bool low_precision = !masters.empty();
  Adam8Fn fn = nullptr;
  run_adam<Work<Adam8Span>>(
      params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps, weight_decay, decoupled,
      bias_correction, lr_tensor, inv_scale, found_inf, status, &eight,
      [&](size_t i, int64_t begin, int64_t n, const AdamCoeffs* c) {
        if (fn == nullptr) {
          fn = kernels().adam8[dtype_index(params[0].scalar_type(), "params")]
                              [dtype_index(grads[0].scalar_type(), "grads")];
        }
        const float step = *steps[i].data_ptr<float>();
        char* p = static_cast<char*>(params[i].data_ptr());
        const char* g = static_cast<const char*>(grads[i].data_ptr());
        float* w = low_precision ? masters[i].data_ptr<float>() : params[i].data_ptr<float>();
        const Adam8Span span{p + begin * params[i].element_size(), g + begin * grads[i].element_size(),
                             w + begin, exp_avgs[i].data_ptr<uint8_t>() + begin,
                             exp_avg_sqs[i].data_ptr<uint8_t>() + begin,
                             exp_avg_scales[i].data_ptr<float>() + begin / kAdam8Block,
                             exp_avg_sq_scales[i].data_ptr<float>() + begin / kAdam8Block,
                             static_cast<uint64_t>(begin), adam8_seed(step, salts[i], false),
                             adam8_seed(step, salts[i], true)};
        return Work<Adam8Span>{span, n, c};
      },
      [&](const Work<Adam8Span>& item) { fn(item.span, item.n, *item.coeffs); });
}

// A checkpoint's moments to and from 8-bit ones: what torch ops in python/effmem/optim/_adam8.py compute
// at about 1.3M elements a second here (a 7B model's moments in an hour and a half), on the pool.
void check_flat(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
  check_defined(t, name);
  TORCH_CHECK_VALUE(t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == dtype &&
                        t.dim() == 1 && t.is_contiguous() && t.numel() == numel,
                    name, " must be a contiguous 1-D ", dtype, " CPU tensor of ", numel, " elements, got ",
                    describe(t));
}

template <class Fn>
void run_blocks(int64_t n, Fn&& fn) {
  static_assert(kAdamSpan % kAdam8Block == 0, "spans must start on block boundaries");
  intra_op_pool()->run((n + kAdamSpan - 1) / kAdamSpan,
                       [&](int64_t t) { fn(t * kAdamSpan, std::min(kAdamSpan, n - t * kAdamSpan)); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> adam8_encode_cpu(const at::Tensor& m,
                                                                            const at::Tensor& v, double step,
                                                                            int64_t salt) {
  check_defined(m, "m");
  const int64_t n = m.numel();
  check_flat(m, "m", at::kFloat, n);
  check_flat(v, "v", at::kFloat, n);
  TORCH_CHECK_VALUE(step >= 0.0 && step < 0x1p63 && step == std::floor(step),
                    "step must be a whole number in [0, 2^63) (the step count of the moments), got ", step);
  const int64_t blocks = adam8_blocks(n);
  at::Tensor mc = at::empty({n}, m.options().dtype(at::kByte)), vc = at::empty({n}, m.options().dtype(at::kByte));
  at::Tensor ms = at::empty({blocks}, m.options()), vs = at::empty({blocks}, m.options());
  const Adam8EncodeFn fn = kernels().adam8_encode;
  const uint64_t seed_m = adam8_seed(static_cast<float>(step), salt, false);
  const uint64_t seed_v = adam8_seed(static_cast<float>(step), salt, true);
  run_blocks(n, [&](int64_t begin, int64_t len) {
    const Adam8Span span{nullptr, nullptr, nullptr, mc.data_ptr<uint8_t>() + begin, vc.data_ptr<uint8_t>() + begin,
                         ms.data_ptr<float>() + begin / kAdam8Block, vs.data_ptr<float>() + begin / kAdam8Block,
                         static_cast<uint64_t>(begin), seed_m, seed_v};
    fn(m.data_ptr<float>() + begin, v.data_ptr<float>() + begin, span, len);
  });
  return {mc, vc, ms, vs};
}

at::Tensor adam8_decode_cpu(const at::Tensor& codes, const at::Tensor& scales, bool second) {
  check_defined(codes, "codes");
  const int64_t n = codes.numel();
  check_flat(codes, "codes", at::kByte, n);
  check_flat(scales, "scales", at::kFloat, adam8_blocks(n));
  at::Tensor out = at::empty({n}, scales.options());
  const Adam8DecodeFn fn = kernels().adam8_decode;
  run_blocks(n, [&](int64_t begin, int64_t len) {
    fn(codes.data_ptr<uint8_t>() + begin, scales.data_ptr<float>() + begin / kAdam8Block, len, second,
       out.data_ptr<float>() + begin);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("adam8_step_", &adam8_step_cpu);
  m.impl("adam8_encode", &adam8_encode_cpu);
  m.impl("adam8_decode", &adam8_decode_cpu);
}

}  // namespace effmem::cpu
