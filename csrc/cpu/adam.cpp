// CPU implementations of effmem::adam_step_ (float32 moments) and
// effmem::adam8_step_ (8-bit moments, common/adam8_math.h): each splits every
// tensor into spans of kAdamSpan elements and runs the vectorised kernel
// (cpu/kernels.inc) for the chosen ISA over them on the intra-op thread pool.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

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
  static_assert(kAdamSpan % kAdam8Block == 0, "spans must start on block boundaries");
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

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("adam8_step_", &adam8_step_cpu);
}

}  // namespace effmem::cpu
