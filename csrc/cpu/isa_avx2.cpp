// AVX2 + FMA + F16C kernels (8 float lanes). Built with -mavx2 -mfma -mf16c
// for this file only; used only when the CPU reports those features.
#include <cstdint>
#include <type_traits>

#include "cpu/dispatch.h"
#include "cpu/simd_common.h"

#if defined(EFFMEM_X86)
#include <immintrin.h>

namespace effmem::cpu {
namespace isa_avx2 {

constexpr const char* kIsaName = "avx2";

struct Vec {
  static constexpr int N = 8;
  __m256 x;
  Vec() = default;
  Vec(__m256 v) : x(v) {}
  explicit Vec(float s) : x(_mm256_set1_ps(s)) {}
};
static inline Vec operator+(Vec a, Vec b) { return _mm256_add_ps(a.x, b.x); }
static inline Vec operator-(Vec a, Vec b) { return _mm256_sub_ps(a.x, b.x); }
static inline Vec operator*(Vec a, Vec b) { return _mm256_mul_ps(a.x, b.x); }
static inline Vec operator/(Vec a, Vec b) { return _mm256_div_ps(a.x, b.x); }
static inline Vec sqrt_(Vec a) { return _mm256_sqrt_ps(a.x); }
// x > acc ? x : acc, lane by lane (MAXPS: the second operand where either is NaN or they are equal)
static inline Vec max_(Vec x, Vec acc) { return _mm256_max_ps(x.x, acc.x); }

static inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
static inline Vec load(const bf16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline Vec load(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.x); }
// Round to nearest even as in common/float_bits.h: add 0x7fff + lsb, keep the
// top 16 bits; NaN lanes become 0x7fc0.
static inline __m128i bf16_bits(Vec a) {
  const __m256i u = _mm256_castps_si256(a.x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(a.x, a.x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void store(bf16_t* p, Vec a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(a)); }
static inline void store(f16_t* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline __m128i bits16(bf16_t*, Vec a) { return bf16_bits(a); }
static inline __m128i bits16(f16_t*, Vec a) {
  return _mm256_cvtps_ph(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// The low-precision param is only written: a streaming store skips reading
// its cache lines first (2 of the 28 bytes per param would otherwise be 4).
template <class T>
static inline void store_stream(T* p, Vec a) {
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), bits16(p, a));
  } else {
    store(p, a);
  }
}
static inline void stream_fence() { _mm_sfence(); }

#include "cpu/kernels.inc"

}  // namespace isa_avx2

const KernelTable& kernels_avx2() { return isa_avx2::table(); }

}  // namespace effmem::cpu

#else
namespace effmem::cpu {
const KernelTable& kernels_avx2() { return kernels_scalar(); }
}  // namespace effmem::cpu
#endif
