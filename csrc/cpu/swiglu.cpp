// CPU implementation of effmem::swiglu and effmem::swiglu_backward: the
// per-element math of common/swiglu_math.h over spans of the flattened
// tensors, one span per task of the intra-op pool. The math is plain float
// arithmetic (no libm call), so the compiler vectorises the loops; the
// results do not depend on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <tuple>

#include "common/checks.h"
#include "common/swiglu_math.h"
#include "cpu/elementwise.h"

namespace effmem::cpu {
namespace {

constexpr int64_t kSpan = 1 << 15;

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

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace effmem::cpu
