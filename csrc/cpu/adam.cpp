// CPU implementation of effmem::adam_step_: splits every tensor into spans of
// kAdamSpan elements and runs the vectorised kernel (cpu/kernels.inc) for the
// chosen ISA over them on the intra-op thread pool.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "common/adam_math.h"
#include "common/checks.h"
#include "common/thread_pool.h"
#include "cpu/dispatch.h"

namespace effmem::cpu {
namespace {

float scalar_value(const std::optional<at::Tensor>& t, float fallback) {
  return t.has_value() ? *t->data_ptr<float>() : fallback;
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool decoupled, bool bias_correction, const std::optional<at::Tensor>& lr_tensor,
                   const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& status) {
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                  weight_decay, lr_tensor, inv_scale, found_inf, status);
  if (params.empty()) return;
  // A grad scaler found inf/nan in the gradients: skip the whole step.
  if (scalar_value(found_inf, 0.0f) != 0.0f) return;
  const double step_lr = lr_tensor.has_value() ? scalar_value(lr_tensor, 0.0f) : lr;
  // Host memory: the values are checked here, before anything is written.
  if (lr_tensor.has_value()) check_lr_value(step_lr, "lr_tensor");
  for (size_t i = 0; i < steps.size(); ++i) check_step_value(*steps[i].data_ptr<float>(), i);
  const double grad_scale = scalar_value(inv_scale, 1.0f);

  const KernelTable& table = kernels();
  const AdamFn fn = table.adam[dtype_index(params[0].scalar_type(), "params")]
                              [dtype_index(grads[0].scalar_type(), "grads")];
  const bool low_precision = !masters.empty();

  struct Work {
    AdamSpan span;
    int64_t n;
    const AdamCoeffs* coeffs;
  };
  std::vector<AdamCoeffs> coeffs(params.size());
  std::vector<Work> work;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    if (numel == 0) continue;
    coeffs[i] = adam_coeffs(step_lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction,
                            *steps[i].data_ptr<float>(), grad_scale);
    const int64_t psize = params[i].element_size();
    const int64_t gsize = grads[i].element_size();
    char* p = static_cast<char*>(params[i].data_ptr());
    const char* g = static_cast<const char*>(grads[i].data_ptr());
    float* w = low_precision ? masters[i].data_ptr<float>() : params[i].data_ptr<float>();
    float* m = exp_avgs[i].data_ptr<float>();
    float* v = exp_avg_sqs[i].data_ptr<float>();
    for (int64_t begin = 0; begin < numel; begin += kAdamSpan) {
      const AdamSpan span{p + begin * psize, g + begin * gsize, w + begin, m + begin, v + begin};
      work.push_back({span, std::min(kAdamSpan, numel - begin), &coeffs[i]});
    }
  }
  intra_op_pool()->run(static_cast<int64_t>(work.size()), [&](int64_t k) {
    const Work& item = work[k];
    fn(item.span, item.n, *item.coeffs);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) { m.impl("adam_step_", &adam_step_cpu); }

}  // namespace effmem::cpu
