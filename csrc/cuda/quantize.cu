// CUDA implementations of effmem::quantize / effmem::dequantize: argument
// checks and the launch (kernels in cuda/quantize_kernel.cuh and cuda/dequantize_flat_kernel.cuh, math in
// common/quant_math.h, shared with the CPU kernels). One read of x, one write
// of codes and stats; dequantisation is one read of codes and stats, one
// write of the output.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "common/checks.h"
#include "cuda/dtype_dispatch.cuh"
#include "cuda/dequantize_flat_kernel.cuh"
#include "cuda/quantize_kernel.cuh"
#include "cuda/quantize_launch.h"

namespace effmem::cuda {
namespace {

void check_one_launch(const QuantLayout& l, int64_t group_size) {
  TORCH_CHECK(fits_one_launch(l, group_size), "quantize: ", l.rows * l.groups_per_row, " groups of ", group_size,
              " are more than one launch indexes; quantise the tensor in parts");
}

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits, int64_t group_size,
                                                 int64_t seed, bool stochastic) {
  check_quantize_args(x, bits, group_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t last_dim = x.dim() == 0 ? 1 : x.size(-1);
  const QuantLayout l = quant_layout(x.numel(), last_dim, bits, group_size);
  at::Tensor codes = at::empty({l.rows, l.row_bytes}, x.options().dtype(at::kByte));
  at::Tensor stats = at::empty({l.rows, l.groups_per_row, 2}, x.options().dtype(at::kFloat));
  if (l.rows * l.groups_per_row == 0) return {codes, stats};
  check_one_launch(l, group_size);
  const bool vec = vector_path(last_dim, x.data_ptr(), codes.data_ptr());
  const int per_thread = quantize_per_thread(bits, group_size, last_dim, vec);
  const QuantShape s = make_shape(l, group_size, per_thread);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(x.scalar_type(), "x", [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_quantize_kernel<T>(bits, vec, per_thread, [&](auto kernel) {
      kernel<<<num_blocks(s), kQuantThreads, 0, stream>>>(static_cast<const T*>(x.data_ptr()),
                                                           codes.data_ptr<uint8_t>(), stats.data_ptr<float>(), s,
                                                           static_cast<uint64_t>(seed), stochastic);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {codes, stats};
}

at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& stats, int64_t bits, int64_t group_size,
                           int64_t last_dim, at::ScalarType dtype) {
  check_dequantize_args(codes, stats, bits, group_size, last_dim, dtype);
  const c10::cuda::CUDAGuard guard(codes.device());
  const QuantLayout l = quant_layout(codes.size(0) * last_dim, last_dim, bits, group_size);
  at::Tensor out = at::empty({codes.size(0), last_dim}, codes.options().dtype(dtype));  // rows as codes'
  if (l.rows * l.groups_per_row == 0) return out;
  check_one_launch(l, group_size);
  const QuantShape s = make_shape(l, group_size);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vector_path(last_dim, out.data_ptr(), codes.data_ptr());
  // Whole groups (the common case: hidden sizes are multiples of the group size): the flat kernel, whose
  // warps store contiguous bytes; rows ending in a part group keep the group-mapped kernel.
  const bool flat = vec && last_dim % group_size == 0;
  dispatch_float_dtype(dtype, "dtype", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (flat) {
      const int64_t numel = l.rows * last_dim;
      const unsigned blocks = flat_blocks(numel);
      const auto log2g = static_cast<uint32_t>(__builtin_ctzll(static_cast<uint64_t>(group_size)));
      const auto launch = [&](auto kernel) {
        kernel<<<blocks, kQuantThreads, 0, stream>>>(codes.data_ptr<uint8_t>(), stats.data_ptr<float>(),
                                                     static_cast<T*>(out.data_ptr()), numel, log2g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      bits == 8 ? launch(dequantize_flat_kernel<T, 8>) : launch(dequantize_flat_kernel<T, 4>);
      return;
    }
    const auto run = [&](auto kernel) {
      kernel<<<num_blocks(s), kQuantThreads, 0, stream>>>(codes.data_ptr<uint8_t>(), stats.data_ptr<float>(),
                                                           static_cast<T*>(out.data_ptr()), s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (bits == 8) {
      vec ? run(dequantize_kernel<T, 8, true>) : run(dequantize_kernel<T, 8, false>);
    } else {
      vec ? run(dequantize_kernel<T, 4, true>) : run(dequantize_kernel<T, 4, false>);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(effmem, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
}

}  // namespace effmem::cuda
