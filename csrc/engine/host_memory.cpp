#include "engine/host_memory.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace effmem::engine {

HostMemoryCounters& host_memory_counters() {
  static HostMemoryCounters counters;
  return counters;
}

HostBlock::HostBlock(void* ptr, int64_t bytes, bool pinned, Free free)
    : ptr_(ptr), bytes_(bytes), pinned_(pinned), free_(free) {
  (pinned ? host_memory_counters().pinned : host_memory_counters().pageable) += bytes;
}

HostBlock::~HostBlock() {
  if (ptr_ != nullptr) free_(ptr_);
  (pinned_ ? host_memory_counters().pinned : host_memory_counters().pageable) -= bytes_;
}

std::shared_ptr<HostBlock> allocate_pageable(int64_t bytes) {
  constexpr int64_t kAlign = 64;
  const int64_t rounded = (std::max<int64_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  void* ptr = std::aligned_alloc(kAlign, static_cast<size_t>(rounded));
  TORCH_CHECK(ptr != nullptr, "OffloadAdam: could not allocate ", bytes, " bytes of host memory");
  std::memset(ptr, 0, static_cast<size_t>(rounded));
  return std::make_shared<HostBlock>(ptr, bytes, false, &std::free);
}

}  // namespace effmem::engine
