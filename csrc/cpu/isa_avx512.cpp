// AVX-512 kernels (16 float lanes). Built with -mavx512f/bw/vl/dq for this file only;
// used only when the CPU reports all four (plus the AVX2 set).
#include <cstdint>
#include <type_traits>

#include "cpu/dispatch.h"
#include "cpu/simd_common.h"

#if defined(EFFMEM_X86)
#include <immintrin.h>

namespace effmem::cpu {
namespace isa_avx512 {

constexpr const char* kIsaName = "avx512";

struct Vec {
  static constexpr int N = 16;
  __m512 x;
  Vec() = default;
  Vec(__m512 v) : x(v) {}
  explicit Vec(float s) : x(_mm512_set1_ps(s)) {}
};
static inline Vec operator+(Vec a, Vec b) { return _mm512_add_ps(a.x, b.x); }
static inline Vec operator-(Vec a, Vec b) { return _mm512_sub_ps(a.x, b.x); }
static inline Vec operator*(Vec a, Vec b) { return _mm512_mul_ps(a.x, b.x); }
static inline Vec operator/(Vec a, Vec b) { return _mm512_div_ps(a.x, b.x); }
static inline Vec sqrt_(Vec a) { return _mm512_sqrt_ps(a.x); }
// x > acc ? x : acc, lane by lane (the second operand where either is NaN or they are equal)
static inline Vec max_(Vec x, Vec acc) { return _mm512_max_ps(x.x, acc.x); }

static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec load(const bf16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
static inline Vec load(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.x); }
// Round to nearest even as in common/float_bits.h; NaN lanes become 0x7fc0.
static inline __m256i bits16(bf16_t*, Vec a) {
  const __m512i u = _mm512_castps_si512(a.x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.x, a.x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
static inline __m256i bits16(f16_t*, Vec a) {
  return _mm512_cvtps_ph(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
template <class T>
static inline void store(T* p, Vec a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits16(p, a));
}
// The low-precision param is only written: a streaming store skips reading
// its cache lines first (2 of the 28 bytes per param would otherwise be 4).
template <class T>
static inline void store_stream(T* p, Vec a) {
  if (reinterpret_cast<uintptr_t>(p) % 32 == 0) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bits16(p, a));
  } else {
    store(p, a);
  }
}
static inline void stream_fence() { _mm_sfence(); }

#include "cpu/kernels.inc"

}  // namespace isa_avx512

const KernelTable& kernels_avx512() { return isa_avx512::table(); }

}  // namespace effmem::cpu

#else
namespace effmem::cpu {
const KernelTable& kernels_avx512() { return kernels_scalar(); }
}  // namespace effmem::cpu
#endif
