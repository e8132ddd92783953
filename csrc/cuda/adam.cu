// CUDA implementations of effmem::adam_step_ and effmem::adam8_step_ (kernels in
// adam_kernel.cuh and adam8_kernel.cuh).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "common/checks.h"
#include "cuda/adam8_kernel.cuh"
#include "cuda/adam_kernel.cuh"
#include "cuda/dtype_dispatch.cuh"

namespace effmem::cuda {
namespace {

const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool decoupled, bool bias_correction, const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& status) {
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                  weight_decay, lr_tensor, inv_scale, found_inf, status);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  std::vector<std::vector<void*>> lists(5);
  std::vector<int64_t> numels;
  std::vector<const float*> step_ptrs;
  for (size_t i = 0; i < params.size(); ++i) {
    lists[0].push_back(params[i].data_ptr());
    lists[1].push_back(grads[i].data_ptr());
    lists[2].push_back(masters.empty() ? params[i].data_ptr() : masters[i].data_ptr());
    lists[3].push_back(exp_avgs[i].data_ptr());
    lists[4].push_back(exp_avg_sqs[i].data_ptr());
    numels.push_back(params[i].numel());
    step_ptrs.push_back(steps[i].data_ptr<float>());
  }
  const AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction};
  const float* lr_ptr = optional_ptr(lr_tensor);
  const float* scale_ptr = optional_ptr(inv_scale);
  const float* inf_ptr = optional_ptr(found_inf);
  int* status_ptr = status.has_value() ? status->data_ptr<int>() : nullptr;

  dispatch_float_dtype(params[0].scalar_type(), "params", [&](auto ptag) {
    dispatch_float_dtype(grads[0].scalar_type(), "grads", [&](auto gtag) {
      using P = typename decltype(ptag)::type;
      using G = typename decltype(gtag)::type;
      for_each_launch<5, 56>(lists, numels, step_ptrs, [&](const AdamTable& table, int blocks) {
        adam_kernel<P, G><<<blocks, kAdamThreads, 0, stream>>>(table, hyper, lr_ptr, scale_ptr, inf_ptr,
                                                                status_ptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

void adam8_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                     at::TensorList masters, at::TensorList steps, at::IntArrayRef salts, double lr, double beta1,
                     double beta2, double eps, double weight_decay, bool decoupled, bool bias_correction,
                     const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& status) {
  const Adam8State eight{exp_avg_scales, exp_avg_sq_scales, salts};
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                  weight_decay, lr_tensor, inv_scale, found_inf, status, &eight);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Empty tensors are left out here, so that the launches' slots follow `kept` one for one.
  std::vector<std::vector<void*>> lists(7);
  std::vector<int64_t> numels, kept_salts;
  std::vector<const float*> step_ptrs;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    lists[0].push_back(params[i].data_ptr());
    lists[1].push_back(grads[i].data_ptr());
    lists[2].push_back(masters.empty() ? params[i].data_ptr() : masters[i].data_ptr());
    lists[3].push_back(exp_avgs[i].data_ptr());
    lists[4].push_back(exp_avg_sqs[i].data_ptr());
    lists[5].push_back(exp_avg_scales[i].data_ptr());
    lists[6].push_back(exp_avg_sq_scales[i].data_ptr());
    numels.push_back(params[i].numel());
    step_ptrs.push_back(steps[i].data_ptr<float>());
    kept_salts.push_back(salts[i]);
  }
  const AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction};
  const float* lr_ptr = optional_ptr(lr_tensor);
  const float* scale_ptr = optional_ptr(inv_scale);
  const float* inf_ptr = optional_ptr(found_inf);
  int* status_ptr = status.has_value() ? status->data_ptr<int>() : nullptr;

  dispatch_float_dtype(params[0].scalar_type(), "params", [&](auto ptag) {
    dispatch_float_dtype(grads[0].scalar_type(), "grads", [&](auto gtag) {
      using P = typename decltype(ptag)::type;
      using G = typename decltype(gtag)::type;
      size_t done = 0;  // tensors in earlier launches
      for_each_launch<7, kAdam8Tensors>(lists, numels, step_ptrs, [&](const Adam8Table& table, int blocks) {
        Adam8Salts s{};
        for (int k = 0; k < table.num_tensors; ++k) s.salt[k] = kept_salts[done + static_cast<size_t>(k)];
        done += static_cast<size_t>(table.num_tensors);
        adam8_kernel<P, G><<<blocks, kAdam8Threads, 0, stream>>>(table, s, hyper, lr_ptr, scale_ptr, inf_ptr,
                                                                  status_ptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) {
  m.impl("adam_step_", &adam_step_cuda);
  m.impl("adam8_step_", &adam8_step_cuda);
}

}  // namespace effmem::cuda
