// The fused linear cross-entropy op family (effmem::linear_ce_forward /
// effmem::linear_ce_backward / effmem::linear_ce_forward_backward), device-generic part: argument checks, the
// loop over vocabulary chunks and the matrix products (ATen's, float
// accumulation). Each device supplies the per-chunk element work (formulas in
// common/linear_ce_math.h): CPU in cpu/linear_ce.cpp, CUDA in cuda/linear_ce.cu.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace effmem {

// Per-token state of the forward pass, float32 [N] each.
struct CeState {
  at::Tensor m, s;        // online log-sum-exp: running max and sum of exp(c - m)
  at::Tensor c_target;    // the target's (capped) logit; NaN until its chunk is seen
  at::Tensor c_sum;       // sum of the (capped) logits (label smoothing only)
};

struct CeChunkKernels {
  // z: float32 [N, vc] logits of vocabulary entries [v0, v0 + vc), contiguous; a buffer of the
  // chunk's own, which the kernels may overwrite.
  void (*forward)(const at::Tensor& z, int64_t v0, const at::Tensor& target, double cap, bool need_sum,
                  CeState& state);
  // d loss / d z for the chunk, in dtype: g [N] float32 is each token's incoming gradient
  // (0 for ignored tokens), lse [N] float32 from the forward pass.
  at::Tensor (*grad)(const at::Tensor& z, int64_t v0, const at::Tensor& target, const at::Tensor& lse,
                     const at::Tensor& g, double eps, int64_t vocab, double cap, at::ScalarType dtype);
  // z: float32 [N, V], every logit of each token (whole rows, the kernels' own buffer): the forward's
  // state of these tokens into st (which starts empty), and d loss / d z for incoming gradients g, in
  // dtype (in z's memory where that is float32).
  at::Tensor (*rows)(const at::Tensor& z, const at::Tensor& target, const at::Tensor& g, double eps, double cap,
                     bool need_sum, CeState& st, at::ScalarType dtype);
  // Each class index in [0, vocab) or ignore_index, after the argument checks (the CPU's: reading the
  // targets there costs no host sync); nullptr where the kernels take care of them.
  void (*targets)(const at::Tensor& target, int64_t vocab, int64_t ignore_index) = nullptr;
};

// The ops' argument checks (shapes, dtypes, devices, layouts, label_smoothing, softcap), each naming the
// argument: the device kernels and the fallback for other layouts run them first.
void check_linear_ce_args(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& target, double label_smoothing, double softcap);

std::tuple<at::Tensor, at::Tensor> linear_ce_forward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          const at::Tensor& target, int64_t ignore_index,
                                                          double label_smoothing, double softcap,
                                                          int64_t vocab_chunk, const CeChunkKernels& k);

// Loss and gradients in one pass over chunks of tokens (whole rows of logits: three matrix products, not
// four), for incoming per-token gradients g known before backward (a mean or sum of the loss). Returns
// (loss [N], grad hidden, grad weight, grad bias); the weight gradient is summed over the chunks in
// float32 (its own memory for a float32 weight, a float32 buffer rounded once for a bf16/fp16 one).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ce_forward_backward_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const at::Tensor& g, int64_t ignore_index, double label_smoothing, double softcap,
    int64_t token_chunk, std::array<bool, 3> output_mask, const CeChunkKernels& k);

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_ce_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
    double label_smoothing, double softcap, int64_t vocab_chunk, std::array<bool, 3> output_mask,
    const CeChunkKernels& k);

}  // namespace effmem
