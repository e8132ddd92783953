// Multi-tensor launches: one kernel launch covers many tensors, one block per
// (tensor, chunk) pair. The table names the tensors only (no per-block
// entries), so a launch has as many blocks as its tensors have chunks, runs
// as many full waves as that takes, and the table stays under the classic
// 4 KB of kernel parameters: a launch needs no host-to-device copy and can
// be captured in a CUDA graph.
// Host-only C++ (no CUDA headers), so the table logic can be checked anywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define EFFMEM_TABLE_FN __host__ __device__ inline
#else
#define EFFMEM_TABLE_FN inline
#endif

namespace effmem::cuda {

// Elements per block-chunk; a multiple of every vector width used.
constexpr int64_t kChunk = 1 << 15;

template <int kLists, int kMaxTensors>
struct TensorTable {
  void* ptr[kLists][kMaxTensors];
  int64_t numel[kMaxTensors];
  const float* step[kMaxTensors];  // per-tensor step counts (Adam); null for the norm
  int32_t block_end[kMaxTensors];  // blocks of slots 0..s together: slot s owns [block_end[s-1], block_end[s])
  int32_t num_tensors;
  int32_t first_block;  // this launch's block 0, counted over all launches

  // The slot and the chunk of that slot's tensor that block `b` updates
  // (usable on the device: the scan over at most kMaxTensors is negligible
  // next to the chunk itself).
  template <class Int>
  EFFMEM_TABLE_FN void locate(Int b, int* slot, int64_t* chunk) const {
    int s = 0;
    while (s + 1 < num_tensors && static_cast<int64_t>(b) >= block_end[s]) ++s;
    *slot = s;
    *chunk = static_cast<int64_t>(b) - (s == 0 ? 0 : block_end[s - 1]);
  }
};

// Fills tables from lists[l][t] (tensor t of every list has numels[t]
// elements) and calls launch(table, num_blocks) whenever a table's slots are
// full and once at the end. Empty tensors are skipped.
template <int kLists, int kMaxTensors, class Launch>
void for_each_launch(const std::vector<std::vector<void*>>& lists, const std::vector<int64_t>& numels,
                     const std::vector<const float*>& steps, Launch&& launch) {
  using Table = TensorTable<kLists, kMaxTensors>;
  static_assert(sizeof(Table) <= 4000, "kernel parameter space is limited to 4 KB");
  Table table{};
  int64_t blocks = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t n = numels[t];
    if (n == 0) continue;
    const int slot = table.num_tensors++;
    for (int l = 0; l < kLists; ++l) table.ptr[l][slot] = lists[l][t];
    table.numel[slot] = n;
    table.step[slot] = steps.empty() ? nullptr : steps[t];
    blocks += (n + kChunk - 1) / kChunk;
    table.block_end[slot] = static_cast<int32_t>(blocks);
    if (table.num_tensors == kMaxTensors) {
      launch(table, static_cast<int>(blocks));
      table.first_block += static_cast<int32_t>(blocks);
      table.num_tensors = 0;
      blocks = 0;
    }
  }
  if (blocks > 0) launch(table, static_cast<int>(blocks));
}

}  // namespace effmem::cuda
