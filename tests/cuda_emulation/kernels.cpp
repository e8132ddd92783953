// Runs the CUDA quantize kernels (csrc/cuda/quantize_kernel.cuh, csrc/cuda/dequantize_flat_kernel.cuh) on
// the host, every thread of the launch csrc/cuda/quantize.cu makes (its geometry from cuda/quantize_launch.h),
// for tests/test_cuda_emulated.py: indexing, lanes, shuffles and special groups checked against the CPU
// kernels bit for bit on a machine without a GPU, and (built with -fsanitize=address,undefined) every load
// and store in bounds and aligned.
//   kernels quantize DTYPE BITS ROWS LAST_DIM GROUP_SIZE SEED STOCHASTIC SCALAR IN CODES STATS
//   kernels dequantize DTYPE BITS ROWS LAST_DIM GROUP_SIZE SCALAR CODES STATS OUT      (group-mapped kernel)
//   kernels dequantize_flat DTYPE BITS ROWS LAST_DIM GROUP_SIZE CODES STATS OUT
// DTYPE: f32, bf16 or f16; IN, OUT: raw values of DTYPE; CODES, STATS: raw codes and float32 stats (read, or
// written by quantize). SCALAR 1 takes the guarded per-element path where quantize.cu would take the 16-byte
// one; 0 chooses as quantize.cu does.
#include "host_shim.h"

#include <string>

#include "cuda/dequantize_flat_kernel.cuh"
#include "cuda/quantize_launch.h"

namespace {

using namespace effmem::cuda;

std::vector<unsigned char> read_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) std::exit(2);
  std::vector<unsigned char> data;
  unsigned char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + n);
  std::fclose(f);
  return data;
}

// Buffers of exactly the tensors' sizes, so that the sanitizer sees any access past them; operator new
// aligns them to 16 bytes, as wide as the kernels' widest load or store (torch's allocations are wider).
template <class T>
std::vector<T> read_as(const std::string& path, size_t count) {
  const std::vector<unsigned char> raw = read_file(path);
  if (raw.size() != count * sizeof(T)) std::exit(4);
  std::vector<T> out(count);
  std::memcpy(static_cast<void*>(out.data()), raw.data(), raw.size());
  return out;
}

template <class T>
bool write_file(const std::string& path, const std::vector<T>& data) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool written = std::fwrite(data.data(), sizeof(T), data.size(), f) == data.size();
  std::fclose(f);
  return written;
}

struct Args {
  std::string op;
  int bits;
  int64_t rows, last_dim, group_size;
  std::vector<std::string> rest;
};

template <class T, int kBits>
int run(const Args& a) {
  const effmem::QuantLayout l = effmem::quant_layout(a.rows * a.last_dim, a.last_dim, kBits, a.group_size);
  if (!fits_one_launch(l, a.group_size)) return 5;
  const QuantShape s = make_shape(l, a.group_size);  // the dequantize kernels' (32 values a thread)
  const size_t numel = static_cast<size_t>(a.rows * a.last_dim);
  const size_t n_codes = static_cast<size_t>(l.rows * l.row_bytes), n_stats = static_cast<size_t>(2 * l.rows *
                                                                                                 l.groups_per_row);
  if (a.op == "quantize") {  // SEED STOCHASTIC SCALAR IN CODES STATS
    const uint64_t seed = std::stoull(a.rest[0]);
    const bool stochastic = a.rest[1] == "1", scalar = a.rest[2] == "1";
    const std::vector<T> x = read_as<T>(a.rest[3], numel);
    std::vector<uint8_t> codes(n_codes);
    std::vector<float> stats(n_stats);
    const bool vec = !scalar && vector_path(a.last_dim, x.data(), codes.data());
    const int per_thread = quantize_per_thread(kBits, a.group_size, a.last_dim, vec);
    const QuantShape qs = make_shape(l, a.group_size, per_thread);
    with_quantize_kernel<T>(kBits, vec, per_thread, [&](auto kernel) {
      emu_launch(num_blocks(qs), kQuantThreads,
                 [&] { kernel(x.data(), codes.data(), stats.data(), qs, seed, stochastic); });
    });
    return write_file(a.rest[4], codes) && write_file(a.rest[5], stats) ? 0 : 3;
  }
  const bool flat = a.op == "dequantize_flat";
  const size_t at = flat ? 0 : 1;  // dequantize: SCALAR CODES STATS OUT; dequantize_flat: CODES STATS OUT
  const std::vector<uint8_t> codes = read_as<uint8_t>(a.rest[at], n_codes);
  const std::vector<float> stats = read_as<float>(a.rest[at + 1], n_stats);
  std::vector<T> out(numel);
  if (flat) {
    if (a.last_dim % a.group_size != 0 || !vector_path(a.last_dim, out.data(), codes.data())) return 6;  // not its case
    const auto log2g = static_cast<uint32_t>(__builtin_ctzll(static_cast<uint64_t>(a.group_size)));
    emu_launch(flat_blocks(static_cast<int64_t>(numel)), kQuantThreads, [&] {
      dequantize_flat_kernel<T, kBits>(codes.data(), stats.data(), out.data(), static_cast<int64_t>(numel), log2g);
    });
  } else {
    const bool vec = a.rest[0] != "1" && vector_path(a.last_dim, out.data(), codes.data());
    emu_launch(num_blocks(s), kQuantThreads, [&] {
      (vec ? dequantize_kernel<T, kBits, true> : dequantize_kernel<T, kBits, false>)(codes.data(), stats.data(),
                                                                                     out.data(), s);
    });
  }
  return write_file(a.rest.back(), out) ? 0 : 3;
}

template <class T>
int run_bits(const Args& a) {
  return a.bits == 8 ? run<T, 8>(a) : a.bits == 4 ? run<T, 4>(a) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s OP DTYPE BITS ROWS LAST_DIM GROUP_SIZE ... (see the top of kernels.cpp)\n",
                 argv[0]);
    return 1;
  }
  Args a{argv[1], std::atoi(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), std::atoll(argv[6]),
         std::vector<std::string>(argv + 7, argv + argc)};
  const size_t want = a.op == "quantize" ? 6 : a.op == "dequantize" ? 4 : a.op == "dequantize_flat" ? 3 : 0;
  if (want == 0 || a.rest.size() != want) return 1;
  const std::string dtype = argv[2];
  if (dtype == "f32") return run_bits<float>(a);
  if (dtype == "bf16") return run_bits<effmem::bf16_t>(a);
  if (dtype == "f16") return run_bits<effmem::f16_t>(a);
  return 1;
}
