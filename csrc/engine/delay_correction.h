// delay_correction's device half (common/delay_correction_math.h): w = delay_correct(w, r, g) elementwise over
// n elements of one dtype, as a CUDA kernel on a stream (csrc/cuda/elementwise.cu); the host backend's copy
// thread runs the same math (transfer_host.cpp).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/delay_correction_math.h"

struct CUstream_st;

namespace effmem::cuda {
void launch_delay_correction(void* w, const void* r, const void* g, int64_t n, at::ScalarType dtype,
                             const DelayCorrection& c, CUstream_st* stream);
}  // namespace effmem::cuda
