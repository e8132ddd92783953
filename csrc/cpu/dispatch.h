// Run-time choice of the CPU vector unit. Each ISA translation unit
// (isa_scalar.cpp, isa_avx2.cpp, isa_avx512.cpp) compiles the same kernel
// templates (cpu/kernels.h) with its own -m flags and exports a KernelTable;
// kernels() returns the best table this CPU supports.
#pragma once

#include <cstdint>
#include <string>

#include "common/adam8_math.h"
#include "common/adam_math.h"
#include "common/delay_correction_math.h"
#include "common/quant_math.h"
#include "common/swiglu_math.h"

namespace effmem::cpu {

// Storage formats, indexed as in the tables below.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNumDTypes = 3 };

// OffloadAdam's delay_correction: where an update also writes the prediction of the next step's weights
// (common/delay_correction_math.h) from the state it has just written: pred in the weights' dtype, r in
// DelayR of it. Null pred: no prediction (FusedAdam, the engine's other modes).
struct DelayOut {
  void* pred = nullptr;
  void* r = nullptr;
  const DelayPrediction* c = nullptr;
};

// One contiguous span of an Adam update. For fp32 params `master` is the
// param itself and `param` is unused.
struct AdamSpan {
  void* param;
  const void* grad;
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  DelayOut delay = {};
};

using AdamFn = void (*)(const AdamSpan& span, int64_t n, const AdamCoeffs& c);

// One span of an Adam update with 8-bit moments (common/adam8_math.h): codes and
// block scales instead of float moments. `first` is the flat index of the span's
// first element in its tensor, a multiple of kAdam8Block (the rounding bytes
// are hashed from it); seeds from adam8_seed.
struct Adam8Span {
  void* param;
  const void* grad;
  float* master;
  uint8_t* m_codes;
  uint8_t* v_codes;
  float* m_scale;
  float* v_scale;
  uint64_t first;
  uint64_t seed_m, seed_v;
  DelayOut delay = {};   // predicted from the moments as stored (decoded again), as the next update reads them
};

using Adam8Fn = void (*)(const Adam8Span& span, int64_t n, const AdamCoeffs& c);
// A checkpoint's float32 moments (m, v) into 8-bit ones (the span's codes, scales, first and seeds as for
// Adam8Fn; its param, grad and master unused), and one moment's codes back (second: v's).
using Adam8EncodeFn = void (*)(const float* m, const float* v, const Adam8Span& span, int64_t n);
using Adam8DecodeFn = void (*)(const uint8_t* codes, const float* scales, int64_t n, bool second, float* out);
using SumSqFn = double (*)(const void* x, int64_t n);
// dst[i] = dst[i] + src[i], rounded once to dst's format: what torch's
// `grad += new_grad` computes for bf16/fp16 grads (used by the offload
// engine to accumulate gradients over micro-batches on the host).
using AddFn = void (*)(void* dst, const void* src, int64_t n);

// Adam work is split into spans of this many elements, the unit handed to a
// thread: 64K elements is about 1.8 MB of traffic for bf16 params, large
// enough to amortise scheduling, small enough to balance across threads.
constexpr int64_t kAdamSpan = 1 << 16;

// Group-wise quantisation of a [rows, last_dim] tensor (see common/quant_math.h);
// kernels take a range of flat group indices.
struct QuantJob {
  const void* x;
  uint8_t* codes;
  float* stats;
  int64_t last_dim, group_size, groups_per_row, row_bytes;
  uint64_t seed;
  bool stochastic;
};
struct DequantJob {
  const uint8_t* codes;
  const float* stats;
  void* out;
  int64_t last_dim, group_size, groups_per_row, row_bytes;
};
using QuantFn = void (*)(const QuantJob& job, int64_t group_begin, int64_t group_end);
using DequantFn = void (*)(const DequantJob& job, int64_t group_begin, int64_t group_end);

// SwiGLU and its gradients over n elements (common/swiglu_math.h), for the "fast" activation policy's op:
// the shared scalar math, which each ISA unit's compiler vectorises (its exponential's range clamps and the
// roundings become blends under -fno-trapping-math).
using SwigluFn = void (*)(const void* gate, const void* up, void* out, int64_t n);
using SwigluBackwardFn = void (*)(const void* grad, const void* gate, const void* up, void* dgate, void* dup,
                                  int64_t n);

struct KernelTable {
  const char* name;
  AdamFn adam[kNumDTypes][kNumDTypes];  // [param dtype][grad dtype]
  Adam8Fn adam8[kNumDTypes][kNumDTypes];
  Adam8EncodeFn adam8_encode;
  Adam8DecodeFn adam8_decode;
  SumSqFn sumsq[kNumDTypes];
  AddFn add[kNumDTypes];
  QuantFn quantize[kNumDTypes][2];      // [dtype][0: 4 bits, 1: 8 bits]
  DequantFn dequantize[kNumDTypes][2];
  SwigluFn swiglu[kNumDTypes];
  SwigluBackwardFn swiglu_backward[kNumDTypes];
};

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();

// The table in use: the widest the CPU supports, capped by the environment
// variable EFFMEM_CPU_ISA (scalar, avx2 or avx512) or by set_isa().
const KernelTable& kernels();

// Names of the ISAs this CPU can run, narrowest first.
std::string supported_isas();
// Selects an ISA by name; throws c10::ValueError if unknown or unsupported.
void set_isa(const std::string& name);

}  // namespace effmem::cpu
