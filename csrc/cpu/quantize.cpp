// CPU implementations of effmem::quantize and effmem::dequantize: groups are
// split into spans of about kSpanElems elements and run on the thread pool,
// each span through the vectorised per-ISA kernel (cpu/quantize.inc).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "common/checks.h"
#include "common/thread_pool.h"
#include "cpu/dispatch.h"

namespace effmem::cpu {
namespace {

constexpr int64_t kSpanElems = 1 << 16;

template <class Fn>
void run_groups(int64_t total_groups, int64_t group_size, Fn&& fn) {
  const int64_t per_task = std::max<int64_t>(1, kSpanElems / group_size);
  const int64_t tasks = (total_groups + per_task - 1) / per_task;
  intra_op_pool()->run(tasks, [&](int64_t t) {
    fn(t * per_task, std::min(total_groups, (t + 1) * per_task));
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                int64_t seed, bool stochastic) {
  check_quantize_args(x, bits, group_size);
  const int64_t last_dim = x.dim() == 0 ? 1 : x.size(-1);
  const QuantLayout l = quant_layout(x.numel(), last_dim, bits, group_size);
  at::Tensor codes = at::empty({l.rows, l.row_bytes}, x.options().dtype(at::kByte));
  at::Tensor stats = at::empty({l.rows, l.groups_per_row, 2}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {codes, stats};
  const QuantJob job{x.data_ptr(), codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), l.last_dim,
                     group_size, l.groups_per_row, l.row_bytes, static_cast<uint64_t>(seed), stochastic};
  const QuantFn fn = kernels().quantize[dtype_index(x.scalar_type(), "x")][bits == 8 ? 1 : 0];
  run_groups(l.rows * l.groups_per_row, group_size, [&](int64_t a, int64_t b) { fn(job, a, b); });
  return {codes, stats};
}

at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                          int64_t last_dim, at::ScalarType dtype) {
  check_dequantize_args(codes, stats, bits, group_size, last_dim, dtype);
  const QuantLayout l = quant_layout(codes.size(0) * last_dim, last_dim, bits, group_size);
  at::Tensor out = at::empty({codes.size(0), last_dim}, codes.options().dtype(dtype));  // rows as codes'
  if (out.numel() == 0) return out;
  const DequantJob job{codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), out.data_ptr(), last_dim,
                       group_size, l.groups_per_row, l.row_bytes};
  const DequantFn fn = kernels().dequantize[dtype_index(dtype, "dtype")][bits == 8 ? 1 : 0];
  run_groups(l.rows * l.groups_per_row, group_size, [&](int64_t a, int64_t b) { fn(job, a, b); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace effmem::cpu
