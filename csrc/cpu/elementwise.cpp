// CPU implementations of the "fast" activation policy's elementwise ops, the per-element math of
// common/swiglu_math.h and common/rms_norm_math.h (no libm call: the same bits as the CUDA kernels) over
// spans of the flattened tensors (rows for rms_norm_apply), one span per task of the intra-op pool; the
// results do not depend on the thread count. SwiGLU's spans run the kernel table's (cpu/kernels.inc),
// compiled for this CPU's vector unit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "common/checks.h"
#include "common/rms_norm_math.h"
#include "common/thread_pool.h"
#include "cpu/dispatch.h"

namespace effmem::cpu {
namespace {

constexpr int64_t kSpan = 1 << 15;

// fn(begin, end) over [0, n) in spans of `span`, one task each.
template <class Fn>
void for_spans(int64_t n, int64_t span, Fn&& fn) {
  const int64_t spans = (n + span - 1) / span;
  if (spans <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  intra_op_pool()->run(spans, [&](int64_t k) { fn(k * span, std::min(n, (k + 1) * span)); });
}

// Calls fn(T{}) with the storage tag of a float32, bfloat16 or float16 tensor (checked before).
template <class Fn>
void with_storage(at::ScalarType t, Fn&& fn) {
  if (t == at::kFloat) return fn(float{});
  if (t == at::kBFloat16) return fn(bf16_t{});
  return fn(f16_t{});
}

at::Tensor swiglu_cpu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_swiglu_args(nullptr, gate_in, up_in);
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate, at::MemoryFormat::Contiguous);
  const SwigluFn fn = kernels().swiglu[dtype_index(gate.scalar_type(), "gate")];
  const int64_t size = gate.element_size();
  const char* g = static_cast<const char*>(gate.data_ptr());
  const char* u = static_cast<const char*>(up.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  for_spans(gate.numel(), kSpan, [&](int64_t begin, int64_t end) {
    fn(g + begin * size, u + begin * size, o + begin * size, end - begin);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                       const at::Tensor& up_in) {
  check_swiglu_args(&grad_in, gate_in, up_in);
  const at::Tensor grad = grad_in.contiguous(), gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor dgate = at::empty_like(gate, at::MemoryFormat::Contiguous);
  at::Tensor dup = at::empty_like(gate, at::MemoryFormat::Contiguous);
  const SwigluBackwardFn fn = kernels().swiglu_backward[dtype_index(gate.scalar_type(), "gate")];
  const int64_t size = gate.element_size();
  const char* dy = static_cast<const char*>(grad.data_ptr());
  const char* g = static_cast<const char*>(gate.data_ptr());
  const char* u = static_cast<const char*>(up.data_ptr());
  char* dg = static_cast<char*>(dgate.data_ptr());
  char* du = static_cast<char*>(dup.data_ptr());
  for_spans(gate.numel(), kSpan, [&](int64_t begin, int64_t end) {
    const int64_t at = begin * size;
    fn(dy + at, g + at, u + at, dg + at, du + at, end - begin);
  });
  return {dgate, dup};
}

at::Tensor rms_norm_apply_cpu(const at::Tensor& x_in, const at::Tensor& rstd_in, const at::Tensor& weight_in) {
  check_rms_norm_apply_args(x_in, rstd_in, weight_in);
  const at::Tensor x = x_in.contiguous(), rstd = rstd_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t h = x.size(-1);
  if (x.numel() == 0) return out;
  const int64_t rows = x.numel() / h;
  with_storage(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    const float* rp = rstd.data_ptr<float>();
    T* op = static_cast<T*>(out.data_ptr());
    for_spans(rows, std::max<int64_t>(1, kSpan / h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float rs = rp[r];
        for (int64_t j = 0; j < h; ++j) {
          store_float(op + r * h + j, rms_norm_value<T>(load_as_float(xp + r * h + j), rs, load_as_float(wp + j)));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("rms_norm_apply", &rms_norm_apply_cpu);
}

}  // namespace effmem::cpu
