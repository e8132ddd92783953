#include "common/checks.h"

#include "common/adam8_math.h"
#include "common/adam_math.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

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

void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), name, " must be a tensor, got None");
}

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "a " << t.scalar_type() << " tensor of shape " << t.sizes();
  if (t.layout() != at::kStrided) out << " and layout " << t.layout();
  if (t.layout() == at::kStrided && !t.is_contiguous()) out << " and strides " << t.strides() << " (not contiguous)";
  out << " on " << t.device();
  return out.str();
}

void check_step_value(double step, size_t i) {
  TORCH_CHECK_VALUE((adam_refusal(0.0, step) & 2) == 0, "steps[", i,
                    "] must hold a whole number in [1, 2^63) (the step count after this step), got ", step);
}

void check_lr_value(double lr, const char* name) {
  TORCH_CHECK_VALUE((adam_refusal(lr, 1.0) & 1) == 0, name, " must hold a finite number >= 0, got ", lr);
}

namespace {

void check_strided(const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name, "[", i, "] is ", describe(t),
                    "; only dense (strided) tensors are supported");
}

// Every tensor the step writes must own its memory: an alias (params=[p, p],
// exp_avgs[0] is params[0], overlapping views) would be updated twice or read
// after being written. Gradients are only read and may share memory with
// each other, not with anything written.
struct Span {
  uintptr_t lo, hi;
  bool written;
  const char* name;
  size_t index;
};

void check_no_aliases(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                      at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales) {
  std::vector<Span> spans;
  auto add = [&](at::TensorList list, const char* name, bool written) {
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& t = list[i];
      if (t.numel() == 0 || !t.has_storage() || t.device().is_meta()) continue;
      const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
      spans.push_back({lo, lo + static_cast<uintptr_t>(t.numel() * t.element_size()), written, name, i});
    }
  };
  add(params, "params", true);
  add(exp_avgs, "exp_avgs", true);
  add(exp_avg_sqs, "exp_avg_sqs", true);
  add(masters, "masters", true);
  add(steps, "steps", true);
  add(exp_avg_scales, "exp_avg_scales", true);
  add(exp_avg_sq_scales, "exp_avg_sq_scales", true);
  add(grads, "grads", false);
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  const Span* reach_written = nullptr;  // of the spans so far, the written one reaching furthest
  const Span* reach_any = nullptr;
  for (const Span& s : spans) {
    const Span* other = nullptr;
    if (reach_written != nullptr && s.lo < reach_written->hi) other = reach_written;
    else if (s.written && reach_any != nullptr && s.lo < reach_any->hi) other = reach_any;
    TORCH_CHECK_VALUE(other == nullptr, other == nullptr ? "" : other->name, "[", other == nullptr ? 0 : other->index,
                      "] and ", s.name, "[", s.index, "] share memory; each tensor the Adam step writes, and "
                      "each parameter's step count (the optimizer advances it), must have memory of its own (only "
                      "grads may share memory, with each other)");
    if (s.written && (reach_written == nullptr || s.hi > reach_written->hi)) reach_written = &s;
    if (reach_any == nullptr || s.hi > reach_any->hi) reach_any = &s;
  }
}

// Whether element k of the two tensors' memory is the same logical element
// (shapes already equal): strides of size-1 dimensions, and of empty tensors,
// do not matter.
bool same_memory_order(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return true;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// The kernels walk a tensor's memory as one flat span, so every tensor must be
// dense and non-overlapping, and tensors updated together must share strides
// (then element k of the span is the same logical element in each).
void check_same_layout(const at::Tensor& t, const at::Tensor& param, const char* name, size_t i,
                       const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, "[", i, "] is on ", t.device(),
                    " but params[0] is on ", device, "; all tensors of one call must share a device");
  check_strided(t, name, i);
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), name, "[", i, "] has shape ", t.sizes(),
                    " but params[", i, "] has shape ", param.sizes());
  TORCH_CHECK_VALUE(same_memory_order(t, param), name, "[", i, "] has strides ", t.strides(),
                    " but params[", i, "] has strides ", param.strides(),
                    "; make it match (e.g. torch.empty_like(param).copy_(x))");
}

void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->layout() == at::kStrided, name, " must be a dense tensor, got ", describe(*t));
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
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& status, const Adam8State* eight) {
  const size_t n = params.size();
  if (eight != nullptr) {
    TORCH_CHECK_VALUE(eight->exp_avg_scales.size() == n && eight->exp_avg_sq_scales.size() == n &&
                          eight->salts.size() == n,
                      "exp_avg_scales, exp_avg_sq_scales and salts must have one entry per param, got ",
                      eight->exp_avg_scales.size(), ", ", eight->exp_avg_sq_scales.size(), " and ",
                      eight->salts.size(), " for ", n, " params");
  }
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
                    "params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got ", n, ", ",
                    grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", steps.size());
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n,
                    "masters must be empty (fp32 params) or have one tensor per param, got ", masters.size(),
                    " for ", n, " params");
  // The kernels take these in float32 (lr 1e39 made every weight NaN, eps 1e-50 flushed to 0 divided a zero
  // moment by 0, weight_decay 1e39 sent the weights to -1e38): float32's range, as FusedAdam checks them.
  constexpr double kF32Max = 3.4028234663852886e38, kF32Tiny = 1.1754943508222875e-38;
  TORCH_CHECK_VALUE(lr >= 0.0 && lr <= kF32Max, "lr must be a finite number >= 0 within float32's range, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps >= kF32Tiny && eps <= kF32Max, "eps must be > 0 in float32's normal range, got ", eps);
  // an infinite decay times a weight of 0 is NaN, any other weight -inf/+inf: no step the caller could want
  TORCH_CHECK_VALUE(weight_decay >= 0.0 && weight_decay <= kF32Max,
                    "weight_decay must be a finite number >= 0 within float32's range, got ", weight_decay);
  if (n == 0) return;
  const at::Device device = params[0].device();
  check_scalar_tensor(lr_tensor, "lr_tensor", device);
  check_scalar_tensor(inv_scale, "inv_scale", device);
  check_scalar_tensor(found_inf, "found_inf", device);
  if (status.has_value()) {
    TORCH_CHECK_VALUE(status->layout() == at::kStrided && status->numel() == 1 &&
                          status->scalar_type() == at::kInt && status->device() == device,
                      "status must be a one-element int32 tensor on ", device, ", got ", describe(*status));
  }
  const at::ScalarType param_dtype = params[0].scalar_type();
  const at::ScalarType grad_dtype = grads[0].scalar_type();
  dtype_index(param_dtype, "params");
  dtype_index(grad_dtype, "grads");
  const bool low_precision = param_dtype != at::kFloat;
  TORCH_CHECK_VALUE(low_precision == !masters.empty(),
                    low_precision ? "bf16/fp16 params need fp32 masters" : "fp32 params take no masters (pass [])");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_strided(p, "params", i);
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
    const at::ScalarType state = eight != nullptr ? at::kByte : at::kFloat;
    const char* state_name = eight != nullptr ? "uint8 (8-bit codes)" : "float32";
    TORCH_CHECK_TYPE(exp_avgs[i].scalar_type() == state, "exp_avgs[", i, "] must be ", state_name, ", got ",
                     exp_avgs[i].scalar_type());
    TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == state, "exp_avg_sqs[", i, "] must be ", state_name,
                     ", got ", exp_avg_sqs[i].scalar_type());
    if (eight != nullptr) {
      const int64_t blocks = adam8_blocks(p.numel());
      for (const auto& [list, name] : {std::pair{eight->exp_avg_scales, "exp_avg_scales"},
                                       std::pair{eight->exp_avg_sq_scales, "exp_avg_sq_scales"}}) {
        const at::Tensor& s = list[i];
        TORCH_CHECK_VALUE(s.layout() == at::kStrided && s.scalar_type() == at::kFloat && s.dim() == 1 &&
                              s.numel() == blocks && s.is_contiguous() && s.device() == device,
                          name, "[", i, "] must be a contiguous 1-D float32 tensor of ", blocks,
                          " block scales (one per ", kAdam8Block, " elements of params[", i, "]) on ", device,
                          ", got ", describe(s));
      }
    }
    if (low_precision) {
      check_same_layout(masters[i], p, "masters", i, device);
      TORCH_CHECK_TYPE(masters[i].scalar_type() == at::kFloat, "masters[", i, "] must be float32, got ",
                       masters[i].scalar_type());
    }
    TORCH_CHECK_VALUE(steps[i].layout() == at::kStrided && steps[i].numel() == 1 &&
                          steps[i].scalar_type() == at::kFloat && steps[i].device() == device,
                      "steps[", i, "] must be a one-element float32 tensor on ", device, ", got ",
                      describe(steps[i]));
  }
  check_no_aliases(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
                   eight != nullptr ? eight->exp_avg_scales : at::TensorList{},
                   eight != nullptr ? eight->exp_avg_sq_scales : at::TensorList{});
}

void check_norm_args(at::TensorList tensors) {
  if (tensors.empty()) return;
  const at::Device device = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device() == device, "tensors[", i, "] is on ", t.device(), " but tensors[0] is on ",
                      device, "; call once per device");
    check_strided(t, "tensors", i);
    dtype_index(t.scalar_type(), "tensors");
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), "tensors[", i,
                      "] must be dense and non-overlapping; pass t.contiguous()");
  }
}

void check_swiglu_args(const at::Tensor* grad, const at::Tensor& gate, const at::Tensor& up) {
  if (grad != nullptr) check_defined(*grad, "grad");
  check_defined(gate, "gate");
  check_defined(up, "up");
  TORCH_CHECK_VALUE(gate.layout() == at::kStrided, "gate must be a dense (strided) tensor, got ", describe(gate));
  TORCH_CHECK_TYPE(gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16 ||
                       gate.scalar_type() == at::kHalf,
                   "gate must be float32, bfloat16 or float16, got ", gate.scalar_type());
  const auto same = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.layout() == at::kStrided && t.scalar_type() == gate.scalar_type() &&
                          t.sizes() == gate.sizes() && t.device() == gate.device(),
                      name, " must match gate (", describe(gate), "), got ", describe(t));
  };
  same(up, "up");
  if (grad != nullptr) same(*grad, "grad");
}

void check_rms_norm_apply_args(const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& weight) {
  check_defined(x, "x");
  check_defined(rstd, "rstd");
  check_defined(weight, "weight");
  TORCH_CHECK_VALUE(x.layout() == at::kStrided && x.dim() >= 1 && x.size(-1) >= 1,
                    "x must be a dense (strided) tensor with a last dimension of at least 1, got ", describe(x));
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(weight.layout() == at::kStrided && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                        weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
                    "weight must be a 1-D tensor of x's last size, dtype and device (", describe(x), "), got ",
                    describe(weight));
  // rstd's rows are matched to x's logically (both are made contiguous): its shape must be x's rows', with or
  // without the trailing 1 of keepdim; a mere count let a [3, 2] rstd scale a [2, 3, H] x row by wrong row.
  const auto rows = x.sizes().slice(0, x.dim() - 1);
  const bool row_shape = rstd.sizes() == rows ||
                         (rstd.dim() == x.dim() && rstd.size(-1) == 1 && rstd.sizes().slice(0, rows.size()) == rows);
  TORCH_CHECK_VALUE(rstd.layout() == at::kStrided && rstd.scalar_type() == at::kFloat && row_shape &&
                        rstd.device() == x.device(),
                    "rstd must be float32 with one value per row of x (shape ", rows, " or ", rows,
                    " + [1]) on x's device, got ", describe(rstd));
}

void check_quant_config(int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
                    "group_size must be 32, 64, 128 or 256, got ", group_size);
}

void check_quantize_args(const at::Tensor& x, int64_t bits, int64_t group_size) {
  check_quant_config(bits, group_size);
  check_defined(x, "x");
  TORCH_CHECK_VALUE(x.layout() == at::kStrided, "x must be a dense (strided) tensor, got ", describe(x));
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous; pass x.contiguous()");
}

void check_dequantize_args(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                           int64_t last_dim, at::ScalarType dtype) {
  check_quant_config(bits, group_size);
  check_defined(codes, "codes");
  check_defined(stats, "stats");
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(codes.layout() == at::kStrided && stats.layout() == at::kStrided,
                    "codes and stats must be dense (strided) tensors, got ", describe(codes), " and ", describe(stats));
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kFloat, "stats must be float32, got ", stats.scalar_type());
  TORCH_CHECK_VALUE(last_dim >= 0, "last_dim must be >= 0, got ", last_dim);
  TORCH_CHECK_VALUE(stats.device() == codes.device(), "stats is on ", stats.device(), " but codes on ", codes.device());
  TORCH_CHECK_VALUE(codes.dim() == 2, "codes must be 2-D [rows, bytes per row], got shape ", codes.sizes());
  TORCH_CHECK_VALUE(codes.is_contiguous(), "codes must be contiguous, got strides ", codes.strides(),
                    " for shape ", codes.sizes());
  TORCH_CHECK_VALUE(stats.dim() == 3 && stats.size(2) == 2, "stats must be 3-D [rows, groups, 2], got shape ",
                    stats.sizes());
  TORCH_CHECK_VALUE(stats.is_contiguous(), "stats must be contiguous, got strides ", stats.strides(),
                    " for shape ", stats.sizes());
  // the layout's element count and bits per row in int64 (a huge one overflowed into a size it then refused)
  TORCH_CHECK_VALUE(last_dim <= std::numeric_limits<int64_t>::max() / 8 / std::max<int64_t>(codes.size(0), 1),
                    "last_dim=", last_dim, " is more elements than ", codes.size(0), " rows of codes can describe");
  const QuantLayout l = quant_layout(codes.size(0) * last_dim, last_dim, bits, group_size);
  TORCH_CHECK_VALUE(codes.size(1) == l.row_bytes, "codes has ", codes.size(1), " bytes per row but last_dim=",
                    last_dim, " at ", bits, " bits needs ", l.row_bytes);
  TORCH_CHECK_VALUE(stats.size(0) == codes.size(0), "codes has ", codes.size(0), " rows but stats has ",
                    stats.size(0), "; the rows of codes and stats must match");
  TORCH_CHECK_VALUE(stats.size(1) == l.groups_per_row, "stats has ", stats.size(1), " groups per row but last_dim=",
                    last_dim, " in groups of ", group_size, " needs ", l.groups_per_row);
}

}  // namespace effmem
