// Argument checks shared by the CPU and CUDA implementations of each op, so
// both devices reject the same inputs with the same messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <optional>

#include <cstdint>

namespace effmem {

// Storage format index used by the kernels (see cpu/dispatch.h DType).
int dtype_index(at::ScalarType t, const char* arg);

// Validates the tensor lists of adam_step_ and the hyper-parameters; the
// device of every tensor must be `device`.
void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf);

// Validates the list given to l2norm: floating tensors on one device, dense.
void check_norm_args(at::TensorList tensors);

}  // namespace effmem
