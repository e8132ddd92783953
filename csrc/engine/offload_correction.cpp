// delay_correction's device half as the host backend runs it (the host half is in the CPU Adam kernels:
// cpu/kernels.inc, DelayOut).
#include <c10/util/Exception.h>

#include "common/storage.h"
#include "engine/delay_correction.h"

namespace effmem::engine {
namespace {

template <class T>
void correct_typed(T* w, const DelayR<T>* r, const T* g, int64_t n, const DelayCorrection& c) {
  for (int64_t i = 0; i < n; ++i) {
    store_float(w + i, round_to<T>(delay_correct(load_as_float(w + i), load_as_float(r + i),
                                                 load_as_float(g + i), c)));
  }
}

}  // namespace

void correct_on_host(void* w, const void* r, const void* g, int64_t n, at::ScalarType dtype,
                     const DelayCorrection& c) {
  switch (dtype) {
    case at::kFloat:
      return correct_typed(static_cast<float*>(w), static_cast<const float*>(r), static_cast<const float*>(g), n, c);
    case at::kBFloat16:
      return correct_typed(static_cast<bf16_t*>(w), static_cast<const bf16_t*>(r), static_cast<const bf16_t*>(g),
                           n, c);
    case at::kHalf:
      return correct_typed(static_cast<f16_t*>(w), static_cast<const bf16_t*>(r), static_cast<const f16_t*>(g), n,
                           c);
    default:
      TORCH_CHECK_TYPE(false, "delay_correction: parameters must be float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace effmem::engine
