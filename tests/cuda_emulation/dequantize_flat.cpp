// Runs CUDA's dequantize_flat_kernel (csrc/cuda/dequantize_flat_kernel.cuh) on the host, every thread of
// the launch csrc/cuda/quantize.cu makes, for tests/test_cuda_emulated.py: its indexing, windows and
// partial warps checked against the CPU kernel bit for bit on a machine without a GPU, and (built with
// -fsanitize=address,undefined) every load and store in bounds and aligned.
//   dequantize_flat DTYPE BITS NUMEL GROUP_LOG2 CODES STATS OUT
// DTYPE: f32, bf16 or f16; CODES, STATS: raw files of the codes and the float32 stats; OUT: written raw.
#include "host_shim.h"

#include <cstdio>
#include <string>
#include <vector>

#include "cuda/dequantize_flat_kernel.cuh"

namespace {

std::vector<unsigned char> read_file(const char* path) {
  std::FILE* f = std::fopen(path, "rb");
  if (f == nullptr) std::exit(2);
  std::vector<unsigned char> data;
  unsigned char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + n);
  std::fclose(f);
  return data;
}

template <class T>
int run(int bits, int64_t numel, uint32_t group_log2, const char* codes_path, const char* stats_path,
        const char* out_path) {
  using effmem::cuda::kQuantPerThread;
  using effmem::cuda::kQuantThreads;
  // Buffers of exactly the tensors' sizes, so that the sanitizer sees any access past them; operator new
  // aligns them to 16 bytes, as wide as the kernel's widest load or store (torch's allocations are wider).
  const std::vector<unsigned char> codes_raw = read_file(codes_path);
  const std::vector<unsigned char> stats_raw = read_file(stats_path);
  const std::vector<uint8_t> codes(codes_raw.begin(), codes_raw.end());
  std::vector<float> stats(stats_raw.size() / sizeof(float));
  std::memcpy(stats.data(), stats_raw.data(), stats.size() * sizeof(float));
  std::vector<T> out(numel);
  const int64_t per_block = int64_t{kQuantThreads} * kQuantPerThread;
  const auto blocks = static_cast<unsigned>((numel + per_block - 1) / per_block);
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned t = 0; t < static_cast<unsigned>(kQuantThreads); ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      if (bits == 8) {
        effmem::cuda::dequantize_flat_kernel<T, 8>(codes.data(), stats.data(), out.data(), numel, group_log2);
      } else {
        effmem::cuda::dequantize_flat_kernel<T, 4>(codes.data(), stats.data(), out.data(), numel, group_log2);
      }
    }
  }
  std::FILE* f = std::fopen(out_path, "wb");
  if (f == nullptr) return 3;
  const bool written = std::fwrite(out.data(), sizeof(T), out.size(), f) == out.size();
  std::fclose(f);
  return written ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s DTYPE BITS NUMEL GROUP_LOG2 CODES STATS OUT\n", argv[0]);
    return 1;
  }
  const std::string dtype = argv[1];
  const int bits = std::atoi(argv[2]);
  const int64_t numel = std::atoll(argv[3]);
  const auto group_log2 = static_cast<uint32_t>(std::atoi(argv[4]));
  if (dtype == "f32") return run<float>(bits, numel, group_log2, argv[5], argv[6], argv[7]);
  if (dtype == "bf16") return run<effmem::bf16_t>(bits, numel, group_log2, argv[5], argv[6], argv[7]);
  if (dtype == "f16") return run<effmem::f16_t>(bits, numel, group_log2, argv[5], argv[6], argv[7]);
  return 1;
}
