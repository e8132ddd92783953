// Runs the elementwise CUDA kernels (csrc/cuda/elementwise_kernel.cuh) on the host with the launches
// csrc/cuda/elementwise.cu makes, for tests/test_cuda_emulated_elementwise.py: their vector and element
// paths, tails and grid-stride loops checked against the CPU kernels on a machine without a GPU.
//   elementwise_kernels OP DTYPE N H OFFSET DIR
// OP: swiglu (DIR/g, DIR/u -> DIR/o), swiglu_backward (dy, g, u -> dg, du), rms_norm_apply (x [N / H rows of
// H], rstd float32 per row, w [H] -> y), delay_correction (w, r, g -> w; DIR/c: grad_scale step g2_scale eps).
// N elements of DTYPE (f32, bf16, f16; r of f16 weights is bf16), each tensor OFFSET elements into a buffer
// of its own (1: off the 16-byte alignment of the vector path), raw values in and out.
#include "host_shim.h"
#include "raw_files.h"

#include <fstream>
#include <map>
#include <string>

#include "cuda/elementwise_kernel.cuh"

namespace {

using namespace effmem;
using namespace effmem::cuda;

template <class T>
int run(const std::string& op, int64_t n, int64_t h, size_t offset, const std::string& dir) {
  std::map<std::string, Buffer> t;
  auto in = [&](const std::string& name, size_t elem, size_t count) {
    return load(dir + "/" + name, elem, count, offset, t[name]);
  };
  auto out = [&](const std::string& name, size_t elem, size_t count) {
    t[name] = make_buffer(elem, count, offset);
  };
  const auto un = static_cast<size_t>(n);
  if (op == "swiglu") {
    if (!in("g", sizeof(T), un) || !in("u", sizeof(T), un)) return 2;
    out("o", sizeof(T), un);
    const T *g = t["g"].as<T>(), *u = t["u"].as<T>();
    T* o = t["o"].as<T>();
    emu_launch(blocks_for<T>(n), kThreads, [&] { swiglu_kernel<T>(g, u, o, n, all_aligned(g, u, o)); });
    return store(dir + "/o", t["o"]) ? 0 : 3;
  }
  if (op == "swiglu_backward") {
    if (!in("dy", sizeof(T), un) || !in("g", sizeof(T), un) || !in("u", sizeof(T), un)) return 2;
    out("dg", sizeof(T), un);
    out("du", sizeof(T), un);
    const T *dy = t["dy"].as<T>(), *g = t["g"].as<T>(), *u = t["u"].as<T>();
    T *dg = t["dg"].as<T>(), *du = t["du"].as<T>();
    emu_launch(blocks_for<T>(n), kThreads,
               [&] { swiglu_backward_kernel<T>(dy, g, u, dg, du, n, all_aligned(dy, g, u, dg, du)); });
    return store(dir + "/dg", t["dg"]) && store(dir + "/du", t["du"]) ? 0 : 3;
  }
  if (op == "rms_norm_apply") {
    const int64_t rows = n / h;
    if (!in("x", sizeof(T), un) || !in("rstd", 4, static_cast<size_t>(rows)) || !in("w", sizeof(T), h)) return 2;
    out("y", sizeof(T), un);
    const T *x = t["x"].as<T>(), *w = t["w"].as<T>();
    T* y = t["y"].as<T>();
    const bool vec = h % Vec<T>::kN == 0 && all_aligned(x, w, y);   // as elementwise.cu chooses
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
    emu_launch(blocks, kThreads, [&] { rms_norm_apply_kernel<T>(x, t["rstd"].as<float>(), w, y, rows, h, vec); });
    return store(dir + "/y", t["y"]) ? 0 : 3;
  }
  if (op == "delay_correction") {
    using R = DelayR<T>;
    if (!in("w", sizeof(T), un) || !in("r", sizeof(R), un) || !in("g", sizeof(T), un)) return 2;
    std::ifstream cf(dir + "/c");
    DelayCorrection c{};
    cf >> c.grad_scale >> c.step >> c.g2_scale >> c.eps;
    if (!cf) return 2;
    T* w = t["w"].as<T>();
    const R* r = t["r"].as<R>();
    const T* g = t["g"].as<T>();
    emu_launch(blocks_for<T>(n), kThreads, [&] { delay_correction_kernel<T>(w, r, g, n, c, all_aligned(w, r, g)); });
    return store(dir + "/w", t["w"]) ? 0 : 3;
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s OP DTYPE N H OFFSET DIR (see the top of elementwise_kernels.cpp)\n", argv[0]);
    return 1;
  }
  const std::string op = argv[1], dtype = argv[2];
  const int64_t n = std::atoll(argv[3]), h = std::atoll(argv[4]);
  const auto offset = static_cast<size_t>(std::atoll(argv[5]));
  if (dtype == "f32") return run<float>(op, n, h, offset, argv[6]);
  if (dtype == "bf16") return run<bf16_t>(op, n, h, offset, argv[6]);
  if (dtype == "f16") return run<f16_t>(op, n, h, offset, argv[6]);
  return 1;
}
