// Layout of quantised data for x viewed as [rows, last_dim]: codes [rows, row_bytes], stats [rows,
// groups_per_row, 2]. Plain C++ (no ATen), so that the CUDA kernels' host-side emulation
// (tests/cuda_emulation/) lays data out as the real launches do.
#pragma once

#include <cstdint>

namespace effmem {

struct QuantLayout {
  int64_t rows, last_dim, groups_per_row, row_bytes;
};

inline QuantLayout quant_layout(int64_t numel, int64_t last_dim, int64_t bits, int64_t group_size) {
  QuantLayout l;
  l.last_dim = last_dim;
  l.rows = last_dim > 0 ? numel / last_dim : 0;
  l.groups_per_row = (last_dim + group_size - 1) / group_size;
  l.row_bytes = (last_dim * bits + 7) / 8;
  return l;
}

}  // namespace effmem
