// Just enough of CUDA's device API for the quantize and Adam kernels to compile and run as ordinary host C++.
// emu_launch() runs a grid's warps with each of a warp's 32 lanes on a thread of its own, so that warp
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
inline thread_local EmuDim3 blockIdx, threadIdx, gridDim;

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

// One warp's shuffles: each lane's values in the order it sent them, and which lanes have ended; its
// __syncthreads barrier: lanes arrived, and the barrier's generation.
struct EmuWarp {
  std::mutex m;
  std::condition_variable cv;
  std::vector<uint32_t> sent[32];
  bool done[32] = {};
  unsigned arrived = 0, generation = 0;

  // Every lane still running has reached the barrier (lanes that ended count as arrived): release it.
  void release_if_all_arrived() {
    unsigned ended = 0;
    for (bool d : done) ended += d ? 1u : 0u;
    if (arrived > 0 && arrived + ended == 32) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    }
  }
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

// kernel() for every thread of blocks x threads (threads a multiple of 32). Lane l of every warp runs on
// thread l of 32, made once per launch (ASan makes a thread costly): each goes through the warps in order, the
// lanes of a warp meeting at its shuffles and barriers, and all 32 meet at the end of each block, so that a
// block's shared memory is not the next block's before every warp of it is done with it.
template <class Kernel>
void emu_launch(unsigned blocks, unsigned threads, Kernel kernel) {
  const unsigned warps = threads / 32;
  std::vector<EmuWarp> warp(static_cast<size_t>(warps));
  std::mutex m;
  std::condition_variable cv;
  unsigned at_end = 0, block_done = 0;
  std::vector<std::thread> lanes;
  for (unsigned lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      for (unsigned b = 0; b < blocks; ++b) {
        for (unsigned k = 0; k < warps; ++k) {
          blockIdx.x = b;
          gridDim.x = blocks;
          threadIdx.x = 32 * k + lane;
          emu_warp = &warp[k];
          emu_lane = lane;
          kernel();
          std::lock_guard<std::mutex> lock(warp[k].m);
          warp[k].done[lane] = true;
          warp[k].release_if_all_arrived();
          warp[k].cv.notify_all();
        }
        std::unique_lock<std::mutex> lock(m);
        if (++at_end == 32) {   // the last lane of the block: fresh warps for the next one
          for (EmuWarp& w : warp) {
            for (auto& sent : w.sent) sent.clear();
            std::fill(std::begin(w.done), std::end(w.done), false);
            w.arrived = 0;
          }
          at_end = 0;
          ++block_done;
          cv.notify_all();
        } else {
          cv.wait(lock, [&] { return block_done > b; });
        }
      }
    });
  }
  for (std::thread& t : lanes) t.join();
}
// A barrier holds the lanes of one warp: each lane runs a block's warps in order, so what thread 0 writes to
// shared memory before the barrier (the Adam kernels' coefficients) is seen by every lane of warp 0 after it,
// and by every later warp (each of its lanes has passed warp 0's barrier first). Enough for kernels whose
// shared memory only thread 0 writes.
inline void __syncthreads() {
  EmuWarp& w = *emu_warp;
  std::unique_lock<std::mutex> lock(w.m);
  const unsigned generation = w.generation;
  ++w.arrived;
  w.release_if_all_arrived();
  w.cv.wait(lock, [&] { return w.generation != generation; });
}
// Shared memory: one variable for the whole launch (its blocks run one after another).
#undef __shared__
#define __shared__ static
inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p |= v;
  return old;
}
#define __launch_bounds__(...)
#define asm(...) (void)0
