// What the CPU's elementwise kernels (swiglu.cpp, rms_norm.cpp) share: spans of a flattened tensor run on
// the intra-op pool, and the storage tag of a float32/bfloat16/float16 tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "common/float_bits.h"
#include "common/thread_pool.h"

namespace effmem::cpu {

// fn(begin, end) over [0, n) in spans of `span`, one task each; the results do not depend on the threads.
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

}  // namespace effmem::cpu
