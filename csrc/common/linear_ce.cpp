// The device-generic part of the fused linear cross-entropy (common/linear_ce.h).
//
// linear_ce_forward_backward instead makes whole rows of logits for a chunk of tokens at a time
// ([tb, V] float32, see token_chunk_size) and turns them into the loss and every gradient at once:
// three products, no recompute, for a weight gradient summed in float32 over the chunks (in its own
// memory for a float32 weight; 4 bytes per weight element more for a bf16/fp16 one).
//
// Memory: the logits exist one vocabulary chunk at a time, [N, vc] in float32
// (see chunk_size), never [N, V]. The forward
// keeps per token only its log-sum-exp; the backward recomputes each chunk's
// logits (one extra matrix product, the price of not holding them) and turns
// them into d loss / d logits at once. The weight gradient of a chunk is one
// product over all tokens (float accumulation, one rounding, as unfused); the
// hidden gradient sums the chunks' products in float32 and is rounded once.
#include "common/linear_ce.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "common/checks.h"

namespace effmem {
namespace {

constexpr int64_t kChunkBytes = int64_t(128) << 20;  // float32 logits of one chunk
constexpr int64_t kRowBlock = 4096;                   // tokens per product into the float hidden gradient

// Vocabulary entries per chunk: 1/64 of the vocabulary (so that the chunk's
// logits and their temporaries stay a few percent of what the unfused logits
// take), in multiples of 128 and at least 256 (matrix products too thin to run
// well below that), but no more than kChunkBytes of float32 logits: past 256k
// tokens that is fewer than 128 columns, and the cap wins over the products' speed.
int64_t chunk_size(int64_t tokens, int64_t vocab, int64_t requested) {
  TORCH_CHECK_VALUE(requested >= 0, "vocab_chunk must be >= 0 (0: automatic), got ", requested);
  if (requested > 0) return std::min(requested, vocab);
  const int64_t fit = kChunkBytes / (4 * std::max<int64_t>(tokens, 1));
  const int64_t share = std::max<int64_t>(256, vocab / 64 / 128 * 128);
  return std::max<int64_t>(1, std::min({vocab, share, fit >= 128 ? fit / 128 * 128 : fit}));
}

// Whether a bf16 tensor on the CPU takes part in the products as it is: where the CPU has bf16 dot
// products (AVX512-BF16; every AMX CPU has them too) and ATen's oneDNN is on, they run faster than float32
// products (the default's time 1.60x -> 0.85-0.88x the unfused path's, bench_linear_ce.py --dtype bf16),
// in float accumulation, rounded once to bf16 (the unfused path's logits are rounded so too; ATen has no
// float32 output for them on the CPU). The hidden gradient's chunks (and with gradients made in forward,
// the weight gradient's) are then each rounded to bf16 before their float32 sum: within the error bound
// the tests hold (tests/test_linear_ce_cpu.py). Elsewhere (and for fp16, whose CPU products ATen
// emulates) the inputs are converted to float32 once.
bool cpu_bf16_products(const at::Tensor& t) {
  if (t.is_cuda() || t.scalar_type() != at::kBFloat16) return false;
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has && at::globalContext().userEnabledMkldnn();
#else
  return false;
#endif
}

// a @ b with float32 output and float accumulation. bf16/fp16 inputs on CUDA use
// ATen's mm with an output dtype where this torch has it (cuBLAS then rounds only
// once, to float32); bf16 ones on the CPU (cpu_bf16_products) a bf16 product, exactly
// converted; elsewhere the inputs are converted to float32 first.
at::Tensor mm_float(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat) return at::mm(a, b);
  if (cpu_bf16_products(a) && cpu_bf16_products(b)) return at::mm(a, b).to(at::kFloat);
  if (a.is_cuda()) {
    static const auto op = c10::Dispatcher::singleton().findSchema({"aten::mm", "dtype"});
    if (op.has_value()) {
      return op->typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>().call(a, b, at::kFloat);
    }
  }
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));
}

// acc += a @ b in one product that reads acc and adds to it in float32, where that exists: float32
// operands (addmm_), or bf16/fp16 ones on CUDA through ATen's addmm with an output dtype and acc as both
// input and output (cuBLAS with beta = 1: no [rows, cols] temporary, no separate pass over acc). Returns
// false where this torch has no such product (an older one takes only a self of the operands' dtype, and
// says so before it touches acc); the caller then adds float32 products of bounded size.
bool addmm_float_(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat) {
    acc.addmm_(a, b);
    return true;
  }
  if (!a.is_cuda()) return false;
  static const auto op = c10::Dispatcher::singleton().findSchema({"aten::addmm", "dtype_out"});
  static std::atomic<bool> works{op.has_value()};
  if (!works.load()) return false;
  try {
    at::Tensor out = acc;
    op->typed<at::Tensor&(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::ScalarType,
                          const at::Scalar&, const at::Scalar&, at::Tensor&)>()
        .call(acc, a, b, at::kFloat, 1, 1, out);
    return true;
  } catch (const c10::Error&) {
    works.store(false);
    return false;
  }
}

// The chunk's logits in float32, bias added.
// rows: the weight's rows v0 .. v0 + rows.size(0), already narrowed (and converted, where a caller reuses them)
// A CPU's bf16 product (cpu_bf16_products) takes the bias inside, rounding hW + b once to bf16 as the unfused
// F.linear (addmm) does: rounding hW first and adding b in float32 after broke the bf16 error bound in 8 of 30
// seeds (a reviewer's measurement); elsewhere the float32 product is exact enough for the bias to follow.
at::Tensor chunk_logits(const at::Tensor& hidden, const at::Tensor& rows, const std::optional<at::Tensor>& bias,
                        int64_t v0) {
  if (bias.has_value()) {
    const at::Tensor b = bias->narrow(0, v0, rows.size(0));
    if (b.scalar_type() == at::kBFloat16 && cpu_bf16_products(hidden) && cpu_bf16_products(rows)) {
      return at::addmm(b, hidden, rows.t()).to(at::kFloat);
    }
    return mm_float(hidden, rows.t()).add_(b.to(at::kFloat));
  }
  return mm_float(hidden, rows.t());
}

// Tokens per chunk of whole rows (linear_ce_forward_backward): 1/32 of them (the chunk's float32 logits
// then take about 1% of what the unfused path's logits and their gradients hold, 12 bytes per logit), in
// multiples of 8, at most kChunkBytes of float32 logits, and at least 128 on CUDA, 256 on the CPU. The CPU's
// BLAS packs the whole weight again for each chunk's logits product (one pass over V x H per chunk), so
// thin chunks run poorly there: the three products of a step at 2048 x 32000 x 512 in float32 took
// 1267 ms in chunks of 128 tokens, 1128 ms of 256 and 1020 ms unchunked on this 2-core CPU (64 tokens:
// 1.15x the time of 128). 256 tokens of a 128k vocabulary are also what kChunkBytes allows.
//
// Where a bf16/fp16 weight's gradient is summed in its float32 [V, H] buffer on CUDA, each chunk's product
// reads and writes that buffer once (8 bytes per element) for 2 * tb FLOP per element: at the 256 tokens
// the rule above gives a 128k vocabulary that traffic, not the products, set the time (an H100 does
// about 200 FLOP per byte). There a chunk is at least min(2048, H / 2) tokens: its float32 logits then
// take at most half the buffer's memory, which this way already costs.
int64_t token_chunk_size(int64_t tokens, int64_t vocab, int64_t hidden_size, bool on_cuda, bool sums_in_buffer,
                         int64_t requested) {
  if (requested > 0) return std::min(requested, std::max<int64_t>(tokens, 1));
  const int64_t fit = std::max<int64_t>(8, kChunkBytes / (4 * vocab) / 8 * 8);
  const int64_t share = std::max<int64_t>(on_cuda ? 128 : 256, tokens / 32 / 8 * 8);
  int64_t tb = std::min(share, fit);
  if (sums_in_buffer) tb = std::max(tb, std::min<int64_t>(2048, hidden_size / 2 / 8 * 8));
  return std::max<int64_t>(1, std::min(tokens, tb));
}

// loss = (1 - eps)(lse - c_t) + eps (lse - mean c), 0 for ignored tokens
at::Tensor token_loss(const CeState& st, const at::Tensor& lse, const at::Tensor& target, int64_t ignore_index,
                      double label_smoothing, int64_t vocab) {
  at::Tensor loss = lse - st.c_target;
  if (label_smoothing > 0.0) {
    loss = loss * (1.0 - label_smoothing) + (lse - st.c_sum / static_cast<double>(vocab)) * label_smoothing;
  }
  return loss.masked_fill(target == ignore_index, 0.0);
}

// acc += dz^T h, float32 [V, H], in place (addmm_float_); where that product does not exist, through
// float32 products of a vocabulary slice at a time, so the temporary stays at kChunkBytes.
void add_weight_grad(const at::Tensor& acc, const at::Tensor& dz, const at::Tensor& h) {
  if (addmm_float_(acc, dz.t(), h)) return;
  const int64_t vocab = acc.size(0), slice = std::max<int64_t>(128, kChunkBytes / (4 * std::max<int64_t>(acc.size(1), 1)));
  for (int64_t v0 = 0; v0 < vocab; v0 += slice) {
    const int64_t len = std::min(slice, vocab - v0);
    acc.narrow(0, v0, len).add_(mm_float(dz.narrow(1, v0, len).t(), h));
  }
}

CeState empty_state(int64_t n, const at::TensorOptions& opts) {
  return CeState{at::full({n}, -INFINITY, opts), at::zeros({n}, opts), at::full({n}, NAN, opts), at::zeros({n}, opts)};
}

// On the CPU a bf16/fp16 hidden is converted to float once, not once per chunk (unless its products
// run in bf16: cpu_bf16_products).
at::Tensor gemm_input(const at::Tensor& t) {
  return t.is_cuda() || t.scalar_type() == at::kFloat || cpu_bf16_products(t) ? t.contiguous()
                                                                               : t.to(at::kFloat).contiguous();
}

}  // namespace

void check_linear_ce_args(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& target, double label_smoothing, double softcap) {
  check_defined(hidden, "hidden");
  check_defined(weight, "weight");
  check_defined(target, "target");
  if (bias.has_value()) check_defined(*bias, "bias");
  TORCH_CHECK_VALUE(hidden.layout() == at::kStrided && hidden.dim() == 2,
                    "hidden must be a dense 2-D tensor [tokens, hidden_size], got ", describe(hidden));
  TORCH_CHECK_VALUE(weight.layout() == at::kStrided && weight.dim() == 2,
                    "weight must be a dense 2-D tensor [vocab, hidden_size], got ", describe(weight));
  TORCH_CHECK_VALUE(weight.size(1) == hidden.size(1), "weight has hidden size ", weight.size(1), " but hidden has ",
                    hidden.size(1));
  TORCH_CHECK_VALUE(weight.size(0) >= 1, "weight must have at least one vocabulary row, got shape ", weight.sizes());
  dtype_index(hidden.scalar_type(), "hidden");
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), "weight is ", weight.scalar_type(),
                   " but hidden is ", hidden.scalar_type(), "; give both one dtype (or run under autocast)");
  TORCH_CHECK_VALUE(weight.device() == hidden.device(), "weight is on ", weight.device(), " but hidden on ",
                    hidden.device());
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "target must be int64, got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == hidden.size(0), "target must be [", hidden.size(0),
                    "] (one class index per token), got shape ", target.sizes());
  TORCH_CHECK_VALUE(target.device() == hidden.device(), "target is on ", target.device(), " but hidden on ",
                    hidden.device());
  TORCH_CHECK_VALUE(target.layout() == at::kStrided, "target must be a dense tensor, got ", describe(target));
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->layout() == at::kStrided && bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "bias must be [", weight.size(0), "], got ", describe(*bias));
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), "bias is ", bias->scalar_type(), " but weight is ",
                     weight.scalar_type());
    TORCH_CHECK_VALUE(bias->device() == hidden.device(), "bias is on ", bias->device(), " but hidden on ",
                      hidden.device());
  }
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0,
                    "label_smoothing must be in [0, 1], got ", label_smoothing);
  // the logits are divided by it in float32: past its range, or below its normal numbers, came NaN
  TORCH_CHECK_VALUE(softcap == 0.0 || (softcap >= 1.1754943508222875e-38 && softcap <= 3.4028234663852886e38),
                    "softcap must be 0 (none) or a number in float32's normal range [1.175e-38, 3.403e+38], got ",
                    softcap);
}

std::tuple<at::Tensor, at::Tensor> linear_ce_forward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          const at::Tensor& target, int64_t ignore_index,
                                                          double label_smoothing, double softcap,
                                                          int64_t vocab_chunk, const CeChunkKernels& k) {
  // The products here choose their own precision: autocast must not recast them.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_linear_ce_args(hidden, weight, bias, target, label_smoothing, softcap);
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  if (k.targets != nullptr) k.targets(target, vocab, ignore_index);
  CeState st = empty_state(n, hidden.options().dtype(at::kFloat));
  const bool need_sum = label_smoothing > 0.0;
  const at::Tensor h = gemm_input(hidden);
  const int64_t vc = chunk_size(n, vocab, vocab_chunk);
  if (n > 0) {
    for (int64_t v0 = 0; v0 < vocab; v0 += vc) {
      const int64_t len = std::min(vc, vocab - v0);
      k.forward(chunk_logits(h, weight.narrow(0, v0, len), bias, v0), v0, target, softcap, need_sum, st);
    }
  }
  const at::Tensor lse = st.m + st.s.log();
  return {token_loss(st, lse, target, ignore_index, label_smoothing, vocab), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ce_forward_backward_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const at::Tensor& grad_scale, int64_t ignore_index, double label_smoothing,
    double softcap, int64_t token_chunk, std::array<bool, 3> output_mask, const CeChunkKernels& k) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_linear_ce_args(hidden, weight, bias, target, label_smoothing, softcap);
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  if (k.targets != nullptr) k.targets(target, vocab, ignore_index);
  check_defined(grad_scale, "grad_scale");
  TORCH_CHECK_VALUE(grad_scale.dim() == 1 && grad_scale.size(0) == n && grad_scale.scalar_type() == at::kFloat &&
                        grad_scale.device() == hidden.device(),
                    "grad_scale must be float32 [", n, "] on ", hidden.device(), " (each token's incoming "
                    "gradient), got ", describe(grad_scale));
  TORCH_CHECK_VALUE(token_chunk >= 0, "token_chunk must be >= 0 (0: automatic), got ", token_chunk);
  // Ignored tokens contribute nothing, whatever the caller's grad_scale says (as linear_ce_backward)
  const at::Tensor g = grad_scale.masked_fill(target == ignore_index, 0.0);
  const bool want_h = output_mask[0], want_w = output_mask[1], want_b = output_mask[2] && bias.has_value();
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({n}, f32);
  at::Tensor grad_h = want_h ? at::empty_like(hidden, at::MemoryFormat::Contiguous) : at::empty({0}, hidden.options());
  // The weight gradient is summed over the chunks of tokens in float32: in its own memory for a float32
  // weight, in a float32 buffer rounded once at the end for a bf16/fp16 one (4 more bytes per element).
  at::Tensor grad_w = want_w ? at::zeros({vocab, hidden.size(1)}, f32) : at::empty({0}, weight.options());
  at::Tensor grad_b32 = want_b ? at::zeros({vocab}, f32) : at::Tensor();
  const at::Tensor h = gemm_input(hidden);
  const at::ScalarType dz_dtype = h.scalar_type();
  // Every chunk reads the whole weight: a bf16/fp16 one on the CPU is converted to float once, here (the
  // logits' and the hidden gradient's products both read it in float there; CUDA, and the CPU's bf16
  // products, read it as it is).
  const at::Tensor w = gemm_input(weight);   // hidden's dtype (check_linear_ce_args), so dz_dtype too
  const bool need_sum = label_smoothing > 0.0;
  const bool sums_in_buffer = want_w && hidden.is_cuda() && weight.scalar_type() != at::kFloat;
  const int64_t tb = token_chunk_size(n, vocab, hidden.size(1), hidden.is_cuda(), sums_in_buffer, token_chunk);
  for (int64_t a = 0; a < n; a += tb) {
    const int64_t len = std::min(tb, n - a);
    const at::Tensor hb = h.narrow(0, a, len), tgt = target.narrow(0, a, len);
    CeState st = empty_state(len, f32);
    const at::Tensor dz = k.rows(chunk_logits(hb, w, bias, 0), tgt, g.narrow(0, a, len),
                                 label_smoothing, softcap, need_sum, st, dz_dtype);
    loss.narrow(0, a, len).copy_(token_loss(st, st.m + st.s.log(), tgt, ignore_index, label_smoothing, vocab));
    // These tokens' hidden gradient is whole after one product: rounded once to hidden's dtype.
    if (want_h) {
      at::Tensor rows_h = grad_h.narrow(0, a, len);
      if ((rows_h.scalar_type() == at::kFloat || !rows_h.is_cuda()) && dz.scalar_type() == rows_h.scalar_type() &&
          w.scalar_type() == rows_h.scalar_type()) {
        at::mm_out(rows_h, dz, w);
      } else {
        rows_h.copy_(mm_float(dz, w));
      }
    }
    if (want_w) add_weight_grad(grad_w, dz, hb);
    if (want_b) grad_b32.add_(at::sum(dz, {0}, false, at::kFloat));  // summed in float, no float copy of dz
  }
  if (want_w && weight.scalar_type() != at::kFloat) grad_w = grad_w.to(weight.scalar_type());
  at::Tensor grad_b = want_b ? grad_b32.to(bias->scalar_type()) : at::empty({0}, weight.options());
  return {loss, grad_h, grad_w, grad_b};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_ce_backward_impl(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
    double label_smoothing, double softcap, int64_t vocab_chunk, std::array<bool, 3> output_mask,
    const CeChunkKernels& k) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  check_linear_ce_args(hidden, weight, bias, target, label_smoothing, softcap);
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  if (k.targets != nullptr) k.targets(target, vocab, ignore_index);
  check_defined(grad_loss, "grad_loss");
  check_defined(lse, "lse");
  // a floating gradient: a complex one lost its imaginary part in the float conversion below, with a warning
  TORCH_CHECK_VALUE(grad_loss.dim() == 1 && grad_loss.size(0) == n && at::isFloatingType(grad_loss.scalar_type()),
                    "grad_loss must be a floating [", n, "] tensor (each token's incoming gradient), got ",
                    describe(grad_loss));
  TORCH_CHECK_VALUE(lse.dim() == 1 && lse.size(0) == n && lse.scalar_type() == at::kFloat,
                    "lse must be the float32 [", n, "] from linear_ce_forward, got ", describe(lse));
  // the kernels read both through raw pointers: a CPU tensor beside CUDA ones must not reach them
  TORCH_CHECK_VALUE(lse.device() == hidden.device() && grad_loss.device() == hidden.device(), "lse is on ",
                    lse.device(), " and grad_loss on ", grad_loss.device(), " but hidden on ", hidden.device());
  const bool want_h = output_mask[0], want_w = output_mask[1], want_b = output_mask[2] && bias.has_value();
  at::Tensor grad_h32 = want_h ? at::zeros({n, hidden.size(1)}, hidden.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor grad_w = want_w ? at::empty_like(weight, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor grad_b = want_b ? at::empty_like(*bias) : at::Tensor();
  // Ignored tokens contribute nothing: their incoming gradient is 0.
  const at::Tensor g = grad_loss.to(at::kFloat).masked_fill(target == ignore_index, 0.0).contiguous();
  const at::Tensor h = gemm_input(hidden);
  // The products run in the inputs' dtype on CUDA (float accumulation); the CPU's in float32.
  const at::ScalarType dz_dtype = h.scalar_type();
  const int64_t vc = chunk_size(n, vocab, vocab_chunk);
  if (n > 0 && (want_h || want_w || want_b)) {
    for (int64_t v0 = 0; v0 < vocab; v0 += vc) {
      const int64_t len = std::min(vc, vocab - v0);
      // the chunk's weight rows in dz's dtype (converted to float once on the CPU, for both products)
      const at::Tensor wg = gemm_input(weight.narrow(0, v0, len));
      const at::Tensor dz = k.grad(chunk_logits(h, wg, bias, v0), v0, target, lse, g, label_smoothing,
                                   vocab, softcap, dz_dtype);
      // summed in place where the product can (no [N, H] temporary per chunk), else a block of rows at a time
      if (want_h && !addmm_float_(grad_h32, dz, wg)) {
        for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, n - r0);
          grad_h32.narrow(0, r0, rows).add_(mm_float(dz.narrow(0, r0, rows), wg));
        }
      }
      if (want_w) {
        // [len, H], one product over all tokens, written into its rows (contiguous) where the dtypes allow
        at::Tensor rows_w = grad_w.narrow(0, v0, len);
        if (dz.scalar_type() == grad_w.scalar_type() && h.scalar_type() == grad_w.scalar_type()) {
          at::mm_out(rows_w, dz.t(), h);
        } else {
          rows_w.copy_(at::mm(dz.t(), h));
        }
      }
      if (want_b) grad_b.narrow(0, v0, len).copy_(at::sum(dz, {0}, false, at::kFloat));
    }
  } else {
    if (want_w) grad_w.zero_();
    if (want_b) grad_b.zero_();
  }
  at::Tensor grad_h = want_h ? grad_h32.to(hidden.scalar_type()) : at::empty({0}, hidden.options());
  if (!want_w) grad_w = at::empty({0}, weight.options());
  if (!want_b) grad_b = at::empty({0}, weight.options());
  return {grad_h, grad_w, grad_b};
}

}  // namespace effmem
