// CPU chunk work of the fused linear cross-entropy (driver in common/linear_ce.cpp,
// formulas in common/linear_ce_math.h), composed of ATen's vectorised,
// multithreaded CPU ops working in place in the chunk's logits buffer: these
// passes over it cost little next to the matrix products that make it.
#include <ATen/TensorOperators.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>

#include "common/linear_ce.h"

namespace effmem::cpu {
namespace {

// c = cap * tanh(z / cap), or z; in place: z is the chunk's own logits buffer,
// and working in it keeps the chunk's memory to that one buffer.
void cap_in_place(const at::Tensor& z, double cap) {
  if (cap > 0.0) z.div_(cap).tanh_().mul_(cap);
}

// The chunk's part of each token: which tokens' targets fall in [v0, v0 + len), and where.
std::tuple<at::Tensor, at::Tensor> targets_in_chunk(const at::Tensor& target, int64_t v0, int64_t len) {
  const at::Tensor local = target - v0;
  const at::Tensor inside = (local >= 0) & (local < len);
  return {inside, local.clamp(0, len - 1)};
}

void forward_chunk(const at::Tensor& z, int64_t v0, const at::Tensor& target, double cap, bool need_sum,
                   CeState& st) {
  cap_in_place(z, cap);
  const at::Tensor& c = z;
  auto [inside, idx] = targets_in_chunk(target, v0, c.size(1));
  st.c_target = at::where(inside, c.gather(1, idx.unsqueeze(1)).squeeze(1), st.c_target);
  if (need_sum) st.c_sum = st.c_sum + c.sum(1);
  // online log-sum-exp (lse_merge): m' = max(m, cmax); s' = s exp(m - m') + sum exp(c - m')
  const at::Tensor cmax = c.amax(1);
  const at::Tensor m_new = at::where(st.m > cmax, st.m, cmax);
  const at::Tensor old = at::where(st.m == -INFINITY, at::zeros_like(st.s), st.s * at::exp(st.m - m_new));
  st.s = old + c.sub_(m_new.unsqueeze(1)).exp_().sum(1);
  st.m = m_new;
}

// The softcap's derivative 1 - (c / cap)^2 at the capped logits (undefined without a cap).
at::Tensor cap_factor(const at::Tensor& z, double cap) {
  return cap > 0.0 ? (z / cap).square_().neg_().add_(1.0) : at::Tensor();
}

// dz holds the softmax p: g * (p - (1 - eps) [j = t] - eps / V) * factor, in place, then in `dtype`.
at::Tensor finish_grad(const at::Tensor& dz, const at::Tensor& inside, const at::Tensor& idx, const at::Tensor& g,
                       double eps, int64_t vocab, const at::Tensor& factor, at::ScalarType dtype) {
  if (eps > 0.0) dz.sub_(eps / static_cast<double>(vocab));
  dz.scatter_add_(1, idx.unsqueeze(1), (inside.to(at::kFloat) * -(1.0 - eps)).unsqueeze(1));
  dz.mul_(g.unsqueeze(1));
  if (factor.defined()) dz.mul_(factor);
  return dz.to(dtype);
}

at::Tensor grad_chunk(const at::Tensor& z, int64_t v0, const at::Tensor& target, const at::Tensor& lse,
                      const at::Tensor& g, double eps, int64_t vocab, double cap, at::ScalarType dtype) {
  cap_in_place(z, cap);
  const at::Tensor factor = cap_factor(z, cap);
  const at::Tensor& p = z.sub_(lse.unsqueeze(1)).exp_();  // exp(c - lse)
  auto [inside, idx] = targets_in_chunk(target, v0, p.size(1));
  return finish_grad(p, inside, idx, g, eps, vocab, factor, dtype);
}

at::Tensor rows_chunk(const at::Tensor& z, const at::Tensor& target, const at::Tensor& g, double eps, double cap,
                      bool need_sum, CeState& st, at::ScalarType dtype) {
  const int64_t vocab = z.size(1);
  cap_in_place(z, cap);
  const at::Tensor factor = cap_factor(z, cap);
  auto [inside, idx] = targets_in_chunk(target, 0, vocab);
  st.c_target = at::where(inside, z.gather(1, idx.unsqueeze(1)).squeeze(1), st.c_target);
  if (need_sum) st.c_sum = z.sum(1);
  // Whole rows: m is the row's max, s = sum exp(c - m), and the softmax is exp(c - m) / s.
  st.m = z.amax(1);
  st.s = z.sub_(st.m.unsqueeze(1)).exp_().sum(1);
  const at::Tensor& p = z.mul_(st.s.reciprocal().unsqueeze(1));
  return finish_grad(p, inside, idx, g, eps, vocab, factor, dtype);
}

void check_targets(const at::Tensor& target, int64_t vocab, int64_t ignore_index) {
  const at::Tensor bad = (target != ignore_index) & ((target < 0) | (target >= vocab));
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    TORCH_CHECK_INDEX(false, "target[", i, "] = ", target[i].item<int64_t>(), " is not a class index in [0, ", vocab,
                      ") nor ignore_index (", ignore_index, ")");
  }
}

const CeChunkKernels kCpuKernels{&forward_chunk, &grad_chunk, &rows_chunk, &check_targets};

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                               int64_t ignore_index, double label_smoothing, double softcap,
                                               int64_t vocab_chunk) {
  return linear_ce_forward_impl(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, vocab_chunk,
                                kCpuKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
    double label_smoothing, double softcap, int64_t vocab_chunk, std::array<bool, 3> output_mask) {
  return linear_ce_backward_impl(grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing,
                                 softcap, vocab_chunk, output_mask, kCpuKernels);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_backward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const at::Tensor& g, int64_t ignore_index, double label_smoothing, double softcap,
    int64_t token_chunk, std::array<bool, 3> output_mask) {
  return linear_ce_forward_backward_impl(hidden, weight, bias, target, g, ignore_index, label_smoothing, softcap,
                                         token_chunk, output_mask, kCpuKernels);
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) {
  m.impl("linear_ce_forward", &forward_cpu);
  m.impl("linear_ce_backward", &backward_cpu);
  m.impl("linear_ce_forward_backward", &forward_backward_cpu);
}

}  // namespace effmem::cpu
