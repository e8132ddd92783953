// What the CUDA elementwise kernels (swiglu.cu, rms_norm.cu) share: 16-byte packs of a storage type and
// the test that every pointer of a launch can be read and written in them.
#pragma once

#include <cstdint>

namespace effmem::cuda {

template <class T>
struct alignas(16) Vec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

template <class... Ptr>
bool all_aligned(Ptr... p) {
  return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

}  // namespace effmem::cuda
