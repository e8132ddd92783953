// Just enough of CUDA's device API for the quantize kernels to compile and run as ordinary host C++.
// emu_launch() runs a grid warp by warp, each of a warp's 32 lanes on a thread of its own, so that warp
// shuffles work as on a GPU: a lane's shuffle waits for the lanes of its mask to reach the same shuffle, and
// one that ends without reaching it (undefined on a GPU) aborts the run. What the GPU does in hardware
// (__byte_perm, __umulhi, bit casts) is written out here from the PTX ISA's definitions; inline PTX
// compiles away (kernels here use it for the quantize kernels' min/max and the hardware bf16/fp16 rounding,
// whose portable fallbacks, taken without __CUDA_ARCH__, give the same bits for finite values).
#pragma once

#include <cuda_fp16.h>  // host-compilable: the half conversions, uint2/uint4/float4 and make_*

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

using std::max;
using std::min;

struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 blockIdx, threadIdx;

// Byte s[i] (0-7) of the 8 bytes {y, x} (x the low word) goes to byte i of the result.
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((uint64_t{a} * b) >> 32); }

// One warp's shuffles: each lane's values in the order it sent them, and which lanes have ended.
struct EmuWarp {
  std::mutex m;
  std::condition_variable cv;
  std::vector<uint32_t> sent[32];
  bool done[32] = {};
};
inline thread_local EmuWarp* emu_warp = nullptr;
inline thread_local unsigned emu_lane = 0;

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  EmuWarp& w = *emu_warp;
  const unsigned me = emu_lane, src = me ^ static_cast<unsigned>(lane_mask);
  if (src >= 32 || !((mask >> me) & 1u) || !((mask >> src) & 1u)) {
    std::fprintf(stderr, "lane %u: __shfl_xor_sync(0x%08x, ., %d) reads outside its mask\n", me, mask, lane_mask);
    std::abort();
  }
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  std::unique_lock<std::mutex> lock(w.m);
  const size_t k = w.sent[me].size();  // this is the lane's k-th shuffle; its mask's lanes must make theirs
  w.sent[me].push_back(bits);
  w.cv.notify_all();
  const auto ready = [&] {
    for (unsigned j = 0; j < 32; ++j) {
      if (((mask >> j) & 1u) && w.sent[j].size() <= k && !w.done[j]) return false;
    }
    return true;
  };
  w.cv.wait(lock, ready);
  for (unsigned j = 0; j < 32; ++j) {
    if (((mask >> j) & 1u) && w.sent[j].size() <= k) {
      std::fprintf(stderr, "lane %u: shuffle %zu of mask 0x%08x, which lane %u ended without\n", me, k, mask, j);
      std::abort();
    }
  }
  const uint32_t got = w.sent[src][k];
  T out;
  std::memcpy(&out, &got, 4);
  return out;
}

// kernel() for every thread of blocks x threads (threads a multiple of 32), one warp at a time.
template <class Kernel>
void emu_launch(unsigned blocks, unsigned threads, Kernel kernel) {
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned first = 0; first < threads; first += 32) {
      EmuWarp warp;
      std::vector<std::thread> lanes;
      for (unsigned lane = 0; lane < 32; ++lane) {
        lanes.emplace_back([&, lane] {
          blockIdx.x = b;
          threadIdx.x = first + lane;
          emu_warp = &warp;
          emu_lane = lane;
          kernel();
          std::lock_guard<std::mutex> lock(warp.m);
          warp.done[lane] = true;
          warp.cv.notify_all();
        });
      }
      for (std::thread& t : lanes) t.join();
    }
  }
}
inline void __syncthreads() {}
inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p |= v;
  return old;
}
#define __launch_bounds__(...)
#define asm(...) (void)0
