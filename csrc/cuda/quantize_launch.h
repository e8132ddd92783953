// The launch geometry of the quantize / dequantize kernels (cuda/quantize_kernel.cuh,
// cuda/dequantize_flat_kernel.cuh), in plain C++: csrc/cuda/quantize.cu launches with it, and the kernels'
// host emulation (tests/cuda_emulation/) runs the same grids.
#pragma once

#include <cstdint>

#include "common/quant_layout.h"
#include "cuda/quantize_kernel.cuh"

namespace effmem::cuda {

inline FastDiv make_fast_div(uint32_t d) {
  uint32_t shift = 0;
  while ((uint64_t{1} << shift) < d) ++shift;
  const uint64_t mul = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
  return {static_cast<uint32_t>(mul), shift};
}

// log2 of the lanes (threads of `per_thread` values) that share a group.
inline uint32_t lanes_log2_of(int64_t group_size, int per_thread = kQuantPerThread) {
  uint32_t lanes_log2 = 0;
  while ((int64_t{per_thread} << lanes_log2) < group_size) ++lanes_log2;
  return lanes_log2;
}

// Threads index groups and elements in 32 bits: far beyond any tensor one GPU holds; callers refuse the
// rest (fits_one_launch, at 32 values a thread: the most threads any of the kernels takes).
inline bool fits_one_launch(const QuantLayout& l, int64_t group_size) {
  return l.rows * l.groups_per_row < (int64_t{1} << (31 - lanes_log2_of(group_size)));
}

inline QuantShape make_shape(const QuantLayout& l, int64_t group_size, int per_thread = kQuantPerThread) {
  return {l.last_dim, l.row_bytes, static_cast<uint32_t>(group_size), static_cast<uint32_t>(l.groups_per_row),
          static_cast<uint32_t>(l.rows * l.groups_per_row), lanes_log2_of(group_size, per_thread),
          make_fast_div(static_cast<uint32_t>(l.groups_per_row))};
}

inline unsigned num_blocks(const QuantShape& s) {
  const uint64_t threads = static_cast<uint64_t>(s.total_groups) << s.lanes_log2;
  return static_cast<unsigned>((threads + kQuantThreads - 1) / kQuantThreads);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The 16-byte path: whole 32-element chunks (rows of a multiple of 32) and 16-byte aligned rows.
inline bool vector_path(int64_t last_dim, const void* values, const void* codes) {
  return last_dim % kQuantPerThread == 0 && aligned16(values) && aligned16(codes);
}

// Values a quantize thread takes: 64 for 4-bit codes on the 16-byte path where groups and rows hold whole
// chunks of 64 (quantize_kernel.cuh, top), else 32.
inline int quantize_per_thread(int64_t bits, int64_t group_size, int64_t last_dim, bool vec) {
  constexpr int kWide = 2 * kQuantPerThread;
  return bits == 4 && vec && group_size >= kWide && last_dim % kWide == 0 ? kWide : kQuantPerThread;
}

// The quantize kernel for these choices, handed to launch(kernel): one place decides, for the CUDA launch
// and its host emulation alike.
template <class T, class Launch>
void with_quantize_kernel(int64_t bits, bool vec, int per_thread, Launch&& launch) {
  if (bits == 8) {
    vec ? launch(quantize_kernel<T, 8, true>) : launch(quantize_kernel<T, 8, false>);
  } else if (per_thread == 2 * kQuantPerThread) {
    launch(quantize_kernel<T, 4, true, 2 * kQuantPerThread>);
  } else {
    vec ? launch(quantize_kernel<T, 4, true>) : launch(quantize_kernel<T, 4, false>);
  }
}

// The flat dequantize kernel's grid: whole groups per row (the caller checks), kQuantPerThread values a thread.
inline unsigned flat_blocks(int64_t numel) {
  const int64_t per_block = int64_t{kQuantThreads} * kQuantPerThread;
  return static_cast<unsigned>((numel + per_block - 1) / per_block);
}

}  // namespace effmem::cuda
