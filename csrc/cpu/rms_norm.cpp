// CPU implementation of effmem::rms_norm_apply: weight * (x * rstd) per row, with the roundings of
// common/rms_norm_math.h, rows in spans on the intra-op pool.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

#include "common/checks.h"
#include "common/rms_norm_math.h"
#include "cpu/elementwise.h"

namespace effmem::cpu {
namespace {

at::Tensor rms_norm_apply_cpu(const at::Tensor& x_in, const at::Tensor& rstd_in, const at::Tensor& weight_in) {
  check_rms_norm_apply_args(x_in, rstd_in, weight_in);
  const at::Tensor x = x_in.contiguous(), rstd = rstd_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t h = x.size(-1);
  if (x.numel() == 0) return out;
  const int64_t rows = x.numel() / h;
  with_storage(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    const float* rp = rstd.data_ptr<float>();
    T* op = static_cast<T*>(out.data_ptr());
    for_spans(rows, std::max<int64_t>(1, (int64_t{1} << 15) / h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float rs = rp[r];
        for (int64_t j = 0; j < h; ++j) {
          store_float(op + r * h + j, rms_norm_value<T>(load_as_float(xp + r * h + j), rs, load_as_float(wp + j)));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CPU, m) { m.impl("rms_norm_apply", &rms_norm_apply_cpu); }

}  // namespace effmem::cpu
