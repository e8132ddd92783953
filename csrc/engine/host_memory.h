// Host memory blocks owned by the offload engine. A block is shared: tensors
// that view it (the optimizer state handed to Python) keep it alive after
// the engine is closed, so a view can never dangle.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace effmem::engine {

// Bytes held by live blocks, by kind; the engine reports them so a test can
// show that nothing is allocated per step.
struct HostMemoryCounters {
  std::atomic<int64_t> pinned{0};
  std::atomic<int64_t> pageable{0};
};
HostMemoryCounters& host_memory_counters();

class HostBlock {
 public:
  // Page-locked blocks come from the CUDA transfer backend (cudaHostAlloc);
  // pageable ones from an aligned allocation here.
  using Free = void (*)(void*);
  HostBlock(void* ptr, int64_t bytes, bool pinned, Free free);
  ~HostBlock();
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  void* data() const { return ptr_; }
  int64_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }

 private:
  void* ptr_;
  int64_t bytes_;
  bool pinned_;
  Free free_;
};

// Zero-filled pageable memory, 64-byte aligned (a cache line; the vector
// kernels' loads never straddle one at the start of a parameter).
std::shared_ptr<HostBlock> allocate_pageable(int64_t bytes);

}  // namespace effmem::engine
