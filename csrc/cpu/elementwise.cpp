// CPU implementations of the "fast" activation policy's elementwise ops, the per-element math of
// common/swiglu_math.h and common/rms_norm_math.h (no libm call: the same bits as the CUDA kernels) over
// spans of the flattened tensors (rows for rms_norm_apply), one span per task of the intra-op pool; the
// results do not depend on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "common/checks.h"
#include "common/rms_norm_math.h"
#include "common/swiglu_math.h"
#include "common/thread_pool.h"

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
  with_storage(gate.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(gate.data_ptr());
    const T* u = static_cast<const T*>(up.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    for_spans(gate.numel(), kSpan, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        store_float(o + i, swiglu_value<T>(load_as_float(g + i), load_as_float(u + i)));
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                       const at::Tensor& up_in) {
  check_swiglu_args(&grad_in, gate_in, up_in);
  const at::Tensor grad = grad_in.contiguous(), gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor dgate = at::empty_like(gate, at::MemoryFormat::Contiguous);
  at::Tensor dup = at::empty_like(gate, at::MemoryFormat::Contiguous);
  with_storage(gate.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* dy = static_cast<const T*>(grad.data_ptr());
    const T* g = static_cast<const T*>(gate.data_ptr());
    const T* u = static_cast<const T*>(up.data_ptr());
    T* dg = static_cast<T*>(dgate.data_ptr());
    T* du = static_cast<T*>(dup.data_ptr());
    for_spans(gate.numel(), kSpan, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float a, b;
        swiglu_grads<T>(load_as_float(dy + i), load_as_float(g + i), load_as_float(u + i), &a, &b);
        store_float(dg + i, a);
        store_float(du + i, b);
      }
    });
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
