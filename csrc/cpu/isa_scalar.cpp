// Portable kernels: one float per "vector". The compiler may still use SSE2
// (x86-64 baseline) for these loops; results are the same IEEE operations.
#include <type_traits>

#include "cpu/dispatch.h"
#include "cpu/simd_common.h"

namespace effmem::cpu {
namespace isa_scalar {

constexpr const char* kIsaName = "scalar";

struct Vec {
  static constexpr int N = 1;
  float x;
  Vec() = default;
  explicit Vec(float s) : x(s) {}
};
static inline Vec operator+(Vec a, Vec b) { return Vec(a.x + b.x); }
static inline Vec operator-(Vec a, Vec b) { return Vec(a.x - b.x); }
static inline Vec operator*(Vec a, Vec b) { return Vec(a.x * b.x); }
static inline Vec operator/(Vec a, Vec b) { return Vec(a.x / b.x); }
static inline Vec sqrt_(Vec a) { return Vec(sqrtf(a.x)); }
static inline Vec max_(Vec x, Vec acc) { return x.x > acc.x ? x : acc; }
template <class T>
static inline Vec load(const T* p) { return Vec(load1(p)); }
template <class T>
static inline void store(T* p, Vec a) { store1(p, a.x); }
template <class T>
static inline void store_stream(T* p, Vec a) { store1(p, a.x); }
static inline void stream_fence() {}

#include "cpu/kernels.inc"

}  // namespace isa_scalar

const KernelTable& kernels_scalar() { return isa_scalar::table(); }

}  // namespace effmem::cpu
