// SwiGLU, silu(gate) * up, and its gradients, one element at a time, written
// once for host and device (effmem::swiglu and effmem::swiglu_backward).
//
// Why a kernel: backward of the "fast" activation policy's SwiGLU rebuilds
// silu(gate) * up and then needs both gradients; in torch ops that is five
// elementwise passes (about 32 bytes moved per element in bf16), here two
// (6 bytes to rebuild the output, 10 for both gradients).
//
// The formulas keep the roundings of the torch ops they replace, so results
// stay within a unit in the last place of them (T: the storage dtype, rT:
// rounding to it, identity for float32; all arithmetic in float32):
//   s     = rT(g / (1 + e^-g))              F.silu(gate)
//   out   = rT(s * u)                       F.silu(gate) * up
//   du    = rT(dy * s)                      grad * F.silu(gate)
//   d     = rT(dy * u)                      grad * up
//   sig   = 1 / (1 + e^-g)
//   dg    = rT(d * sig * (1 + g * (1 - sig)))   aten's silu_backward(d, gate)
// The one difference is e^x: exp_f() below, a polynomial of plain float
// operations (the build forbids contraction into FMAs on both devices), so
// that the CPU and CUDA kernels give the same bits; the libraries' expf
// implementations differ from each other in the last place.
#pragma once

#include <cstdint>

#include "float_bits.h"
#include "hd.h"
#include "storage.h"

namespace effmem {

// e^x within a few units in the last place: x = k ln2 + r (Cody-Waite, ln2 in
// two parts, k * the high part exact), e^r by its Taylor series to r^7 on
// |r| <= ln2 / 2 (truncation under 2^-26), times 2^k built in the exponent
// bits (2^127 * 2 for k = 128). Below -87 it returns 0 (e^x leaves the normal
// range, and 1 + e^x rounds to 1 long before); from 88.75 +inf, and between
// ln(FLT_MAX) = 88.7228 and there the product overflows to +inf itself (an
// earlier cut at 88 made e^88.5, 2.7e38, infinite, and silu(-88.5) -0 where
// torch gives -3.2e-37); NaN stays NaN.
EFFMEM_HD float exp_f(float x) {
  // selects, no branches: the CPU loops vectorise (NaN takes the -87 side, then the last line)
  const float xc = x >= -87.0f ? (x <= 88.75f ? x : 88.75f) : -87.0f;
  const float t = xc * 1.44269504088896341f;
  // round to nearest: adding 1.5 * 2^23 leaves no fraction bits (|t| < 2^22)
  const float k = (t + 12582912.0f) - 12582912.0f;
  const float r = (xc - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // k is in [-126, 128] here; 2^k as two normal factors where k = 128 (each multiplication by a power of two is
  // exact until it overflows)
  const float kb = k > 127.0f ? 127.0f : k;
  const float two_k = float_of(static_cast<uint32_t>(static_cast<int32_t>(kb) + 127) << 23);
  const float e = p * two_k * (k > 127.0f ? 2.0f : 1.0f);
  return x > 88.75f ? float_of(0x7f800000u) : (x < -87.0f ? 0.0f : (x != x ? x : e));
}

template <class T>
EFFMEM_HD float swiglu_value(float g, float u) {
  const float s = round_to<T>(g / (1.0f + exp_f(-g)));
  return round_to<T>(s * u);
}

// The two gradients for the incoming gradient dy (each rounded to T).
template <class T>
EFFMEM_HD void swiglu_grads(float dy, float g, float u, float* dg, float* du) {
  const float e = exp_f(-g);
  const float s = round_to<T>(g / (1.0f + e));
  const float sig = 1.0f / (1.0f + e);
  const float d = round_to<T>(dy * u);
  *du = round_to<T>(dy * s);
  *dg = round_to<T>(d * sig * (1.0f + g * (1.0f - sig)));
}

}  // namespace effmem
