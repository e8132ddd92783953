// Multi-tensor launches: one kernel launch covers many tensors by giving each
// block one (tensor, chunk) pair. The tensor table travels in the kernel's
// parameter space (under the classic 4 KB limit), so a launch needs no
// host-to-device copy and can be captured in a CUDA graph.
// Host-only C++ (no CUDA headers), so the table logic can be checked anywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace effmem::cuda {

// Elements per block-chunk; a multiple of every vector width used.
constexpr int64_t kChunk = 1 << 15;

template <int kLists, int kMaxTensors, int kMaxBlocks>
struct TensorTable {
  void* ptr[kLists][kMaxTensors];
  int64_t numel[kMaxTensors];
  const float* step[kMaxTensors];  // per-tensor step counts (Adam); null for the norm
  int32_t first_block;             // this launch's block 0, counted over all launches
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};

// Fills tables from lists[l][t] (tensor t of every list has numels[t]
// elements) and calls launch(table, num_blocks) whenever a table is full and
// once at the end. A tensor whose chunks do not fit continues in the next
// table, in slot 0.
template <int kLists, int kMaxTensors, int kMaxBlocks, class Launch>
void for_each_launch(const std::vector<std::vector<void*>>& lists, const std::vector<int64_t>& numels,
                     const std::vector<const float*>& steps, Launch&& launch) {
  using Table = TensorTable<kLists, kMaxTensors, kMaxBlocks>;
  static_assert(sizeof(Table) <= 4000, "kernel parameter space is limited to 4 KB");
  static_assert(kMaxTensors <= 256, "block_tensor is a uint8_t");
  Table table{};
  int tensors = 0;  // slots in use
  int blocks = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t n = numels[t];
    if (n == 0) continue;
    int slot = tensors++;
    for (int l = 0; l < kLists; ++l) table.ptr[l][slot] = lists[l][t];
    table.numel[slot] = n;
    table.step[slot] = steps.empty() ? nullptr : steps[t];
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = static_cast<uint8_t>(slot);
      table.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last = c == chunks - 1;
      if (blocks == kMaxBlocks || (last && tensors == kMaxTensors)) {
        launch(table, blocks);
        table.first_block += blocks;
        blocks = 0;
        tensors = 0;
        if (!last) {
          for (int l = 0; l < kLists; ++l) table.ptr[l][0] = table.ptr[l][slot];
          table.numel[0] = table.numel[slot];
          table.step[0] = table.step[slot];
          slot = 0;
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) launch(table, blocks);
}

}  // namespace effmem::cuda
