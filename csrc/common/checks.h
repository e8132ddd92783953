// Argument checks shared by the CPU and CUDA implementations of each op, so
// both devices reject the same inputs with the same messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <optional>
#include <string>

#include <cstdint>

#include "common/quant_layout.h"

namespace effmem {

// Storage format index used by the kernels (see cpu/dispatch.h DType).
int dtype_index(at::ScalarType t, const char* arg);

// The 8-bit moments' extra arguments (adam8_step_): block scales and salts.
struct Adam8State {
  at::TensorList exp_avg_scales, exp_avg_sq_scales;
  c10::ArrayRef<int64_t> salts;
};

// Validates the tensor lists of adam_step_ (eight == nullptr: float32 moments)
// or adam8_step_ (uint8 codes and their scales) and the hyper-parameters; all
// tensors of one call share params[0]'s device.
void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& status, const Adam8State* eight = nullptr);

// "a float64 tensor of shape [3] on cpu", for messages.
std::string describe(const at::Tensor& t);

// A Tensor argument given None reaches a kernel undefined, where the first read of its device or dtype failed
// with "tensor does not have a device", naming no argument: each tensor argument is checked by name first.
void check_defined(const at::Tensor& t, const char* name);

// Values read where they cost no device sync (CPU tensors): a step count
// after this step must be a whole number in [1, 2^63), an lr finite and >= 0.
void check_step_value(double step, size_t i);
void check_lr_value(double lr, const char* name);

// Validates the list given to l2norm: floating tensors on one device, dense.
void check_norm_args(at::TensorList tensors);

// Validates quantize/dequantize arguments shared by both devices.
void check_quant_config(int64_t bits, int64_t group_size);
void check_quantize_args(const at::Tensor& x, int64_t bits, int64_t group_size);
void check_dequantize_args(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                           int64_t last_dim, at::ScalarType dtype);

// Validates swiglu's gate and up (and swiglu_backward's grad when not null): strided float32, bfloat16 or
// float16 tensors of one shape, dtype and device.
void check_swiglu_args(const at::Tensor* grad, const at::Tensor& gate, const at::Tensor& up);

// Validates rms_norm_apply's arguments: x strided float32, bfloat16 or float16 with a last dimension of
// at least 1; weight 1-D of x's last size and x's dtype; rstd float32 with one value per row of x; one device.
void check_rms_norm_apply_args(const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& weight);

}  // namespace effmem
