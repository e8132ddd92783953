#include "common/checks.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace effmem {

int dtype_index(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default:
      TORCH_CHECK_TYPE(false, arg, " must be float32, bfloat16 or float16, got ", t);
  }
  return -1;
}

namespace {

// The kernels walk a tensor's memory as one flat span, so every tensor must be
// dense and non-overlapping, and tensors updated together must share strides
// (then element k of the span is the same logical element in each).
void check_same_layout(const at::Tensor& t, const at::Tensor& param, const char* name, size_t i,
                       const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, "[", i, "] is on ", t.device(),
                    " but params[0] is on ", device, "; all tensors of one call must share a device");
  TORCH_CHECK_VALUE(!t.is_sparse(), name, "[", i, "] is sparse; only dense tensors are supported");
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), name, "[", i, "] has shape ", t.sizes(),
                    " but params[", i, "] has shape ", param.sizes());
  TORCH_CHECK_VALUE(t.strides() == param.strides(), name, "[", i, "] has strides ", t.strides(),
                    " but params[", i, "] has strides ", param.strides(),
                    "; make it match (e.g. torch.empty_like(param).copy_(x))");
}

void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->numel() == 1, name, " must hold one element, got ", t->numel());
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->device() == device, name, " is on ", t->device(), " but the params are on ", device);
}

}  // namespace

void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
                    "params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got ", n, ", ",
                    grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", steps.size());
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n,
                    "masters must be empty (fp32 params) or have one tensor per param, got ", masters.size(),
                    " for ", n, " params");
  TORCH_CHECK_VALUE(lr >= 0.0 && std::isfinite(lr), "lr must be a finite number >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps > 0.0, "eps must be > 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "weight_decay must be >= 0, got ", weight_decay);
  if (n == 0) return;
  const at::Device device = params[0].device();
  check_scalar_tensor(lr_tensor, "lr_tensor", device);
  check_scalar_tensor(inv_scale, "inv_scale", device);
  check_scalar_tensor(found_inf, "found_inf", device);
  const at::ScalarType param_dtype = params[0].scalar_type();
  const at::ScalarType grad_dtype = grads[0].scalar_type();
  dtype_index(param_dtype, "params");
  dtype_index(grad_dtype, "grads");
  const bool low_precision = param_dtype != at::kFloat;
  TORCH_CHECK_VALUE(low_precision == !masters.empty(),
                    low_precision ? "bf16/fp16 params need fp32 masters" : "fp32 params take no masters (pass [])");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.device() == device, "params[", i, "] is on ", p.device(), " but params[0] is on ", device);
    TORCH_CHECK_TYPE(p.scalar_type() == param_dtype, "params[", i, "] is ", p.scalar_type(),
                     " but params[0] is ", param_dtype, "; one call takes one param dtype");
    TORCH_CHECK_TYPE(grads[i].scalar_type() == grad_dtype, "grads[", i, "] is ", grads[i].scalar_type(),
                     " but grads[0] is ", grad_dtype, "; one call takes one grad dtype");
    TORCH_CHECK_VALUE(p.is_non_overlapping_and_dense(), "params[", i,
                      "] must be dense and non-overlapping (a contiguous or permuted tensor)");
    check_same_layout(grads[i], p, "grads", i, device);
    check_same_layout(exp_avgs[i], p, "exp_avgs", i, device);
    check_same_layout(exp_avg_sqs[i], p, "exp_avg_sqs", i, device);
    TORCH_CHECK_TYPE(exp_avgs[i].scalar_type() == at::kFloat, "exp_avgs[", i, "] must be float32");
    TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == at::kFloat, "exp_avg_sqs[", i, "] must be float32");
    if (low_precision) {
      check_same_layout(masters[i], p, "masters", i, device);
      TORCH_CHECK_TYPE(masters[i].scalar_type() == at::kFloat, "masters[", i, "] must be float32");
    }
    TORCH_CHECK_VALUE(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat &&
                          steps[i].device() == device,
                      "steps[", i, "] must be a one-element float32 tensor on ", device);
  }
}

void check_norm_args(at::TensorList tensors) {
  if (tensors.empty()) return;
  const at::Device device = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device() == device, "tensors[", i, "] is on ", t.device(), " but tensors[0] is on ",
                      device, "; call once per device");
    TORCH_CHECK_VALUE(!t.is_sparse(), "tensors[", i, "] is sparse; only dense tensors are supported");
    dtype_index(t.scalar_type(), "tensors");
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), "tensors[", i,
                      "] must be dense and non-overlapping; pass t.contiguous()");
  }
}

void check_quant_config(int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
                    "group_size must be 32, 64, 128 or 256, got ", group_size);
}

void check_quantize_args(const at::Tensor& x, int64_t bits, int64_t group_size) {
  check_quant_config(bits, group_size);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous; pass x.contiguous()");
}

void check_dequantize_args(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                           int64_t last_dim, at::ScalarType dtype) {
  check_quant_config(bits, group_size);
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kFloat, "stats must be float32, got ", stats.scalar_type());
  TORCH_CHECK_VALUE(last_dim >= 0, "last_dim must be >= 0, got ", last_dim);
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.is_contiguous(), "codes must be a contiguous 2-D tensor");
  TORCH_CHECK_VALUE(stats.device() == codes.device(), "stats is on ", stats.device(), " but codes on ", codes.device());
  const QuantLayout l = quant_layout(codes.size(0) * last_dim, last_dim, bits, group_size);
  TORCH_CHECK_VALUE(codes.size(1) == l.row_bytes, "codes has ", codes.size(1), " bytes per row but last_dim=",
                    last_dim, " at ", bits, " bits needs ", l.row_bytes);
  TORCH_CHECK_VALUE(stats.is_contiguous() && stats.dim() == 3 && stats.size(0) == l.rows &&
                        stats.size(1) == l.groups_per_row && stats.size(2) == 2,
                    "stats must be a contiguous [", l.rows, ", ", l.groups_per_row, ", 2] tensor, got ",
                    stats.sizes());
}

QuantLayout quant_layout(int64_t numel, int64_t last_dim, int64_t bits, int64_t group_size) {
  QuantLayout l;
  l.last_dim = last_dim;
  l.rows = last_dim > 0 ? numel / last_dim : 0;
  l.groups_per_row = (last_dim + group_size - 1) / group_size;
  l.row_bytes = (last_dim * bits + 7) / 8;
  return l;
}

}  // namespace effmem
