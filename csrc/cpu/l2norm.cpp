// CPU implementation of effmem::l2norm: the global L2 norm of a list of
// tensors, as one float32 scalar. Per-span sums of squares (double) are added
// in a fixed order, so the result does not depend on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common/checks.h"
#include "common/thread_pool.h"
#include "cpu/dispatch.h"

namespace effmem::cpu {
namespace {

constexpr int64_t kSpan = 1 << 17;

at::Tensor l2norm_cpu(at::TensorList tensors) {
  check_norm_args(tensors);
  struct Work {
    const void* data;
    int64_t n;
    SumSqFn fn;
  };
  const KernelTable& table = kernels();
  std::vector<Work> work;
  for (const at::Tensor& t : tensors) {
    const SumSqFn fn = table.sumsq[dtype_index(t.scalar_type(), "tensors")];
    const char* base = static_cast<const char*>(t.data_ptr());
    for (int64_t begin = 0; begin < t.numel(); begin += kSpan) {
      work.push_back({base + begin * t.element_size(), std::min(kSpan, t.numel() - begin), fn});
    }
  }
  std::vector<double> partial(work.size());
  intra_op_pool()->run(static_cast<int64_t>(work.size()),
                       [&](int64_t k) { partial[k] = work[k].fn(work[k].data, work[k].n); });
  double total = 0.0;
  for (double s : partial) total += s;
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kFloat));
  *out.data_ptr<float>() = static_cast<float>(std::sqrt(total));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) { m.impl("l2norm", &l2norm_cpu); }

}  // namespace effmem::cpu
