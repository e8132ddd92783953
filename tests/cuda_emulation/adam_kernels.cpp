// Runs the CUDA Adam kernels (csrc/cuda/adam_kernel.cuh, csrc/cuda/adam8_kernel.cuh) on the host, with the
// launches csrc/cuda/adam.cu makes (for_each_launch's tables, 512 threads a block, 8-bit salts per launch),
// for tests/test_cuda_emulated_adam.py: their indexing, chunking, vector and element paths, warp reductions
// and launches of many tensors checked against the CPU kernels bit for bit on a machine without a GPU.
//   adam_kernels OP PDTYPE GDTYPE DIR
// OP: adam (float32 moments) or adam8; PDTYPE, GDTYPE: f32, bf16 or f16. DIR/spec holds
//   lr beta1 beta2 eps weight_decay decoupled bias_correction inv_scale (0: none)
//   N, then for each tensor: numel offset step salt
// and DIR holds each tensor i's raw values: p<i>, g<i>, w<i> (the master; none for f32 params), m<i>, v<i>
// (float32 moments, or uint8 codes for adam8) and, for adam8, ms<i>, vs<i> (block scales). Each is placed
// `offset` elements into a buffer of its own (an offset of 1 misaligns it for the vector path); the kernels'
// results are written back to the same files.
#include "host_shim.h"
#include "raw_files.h"

#include <fstream>
#include <string>

#include "cuda/adam8_kernel.cuh"

namespace {

using namespace effmem::cuda;

struct Tensor {
  int64_t numel;
  size_t offset;
  float step;
  int64_t salt;
  Buffer p, g, w, m, v, ms, vs;
};

template <class P, class G>
int run(bool eight, const std::string& dir) {
  std::ifstream spec(dir + "/spec");
  AdamHyper h{};
  double inv_scale = 0.0;
  size_t count = 0;
  spec >> h.lr >> h.beta1 >> h.beta2 >> h.eps >> h.weight_decay >> h.decoupled >> h.bias_correction >> inv_scale >>
      count;
  std::vector<Tensor> ts(count);
  const bool master = !std::is_same_v<P, float>;
  const size_t moment = eight ? 1 : 4;
  for (size_t i = 0; i < count; ++i) {
    Tensor& t = ts[i];
    spec >> t.numel >> t.offset >> t.step >> t.salt;
    const std::string at = std::to_string(i);
    const auto n = static_cast<size_t>(t.numel);
    const size_t blocks = static_cast<size_t>(effmem::adam8_blocks(t.numel));
    bool ok = load(dir + "/p" + at, sizeof(P), n, t.offset, t.p) &&
              load(dir + "/g" + at, sizeof(G), n, t.offset, t.g) &&
              load(dir + "/m" + at, moment, n, t.offset, t.m) && load(dir + "/v" + at, moment, n, t.offset, t.v);
    if (master) ok = ok && load(dir + "/w" + at, 4, n, t.offset, t.w);
    if (eight) ok = ok && load(dir + "/ms" + at, 4, blocks, 0, t.ms) && load(dir + "/vs" + at, 4, blocks, 0, t.vs);
    if (!spec || !ok) return 2;
  }
  // adam.cu's lists: empty tensors left out, so that the launches' slots follow the kept ones
  std::vector<std::vector<void*>> lists(eight ? 7 : 5);
  std::vector<int64_t> numels, salts;
  std::vector<const float*> steps;
  for (Tensor& t : ts) {
    if (t.numel == 0) continue;
    void* w = master ? t.w.data() : t.p.data();
    std::vector<void*> row = {t.p.data(), t.g.data(), w, t.m.data(), t.v.data()};
    if (eight) row.insert(row.end(), {t.ms.data(), t.vs.data()});
    for (size_t l = 0; l < row.size(); ++l) lists[l].push_back(row[l]);
    numels.push_back(t.numel);
    steps.push_back(&t.step);
    salts.push_back(t.salt);
  }
  const float scale = static_cast<float>(inv_scale);
  const float* scale_ptr = inv_scale != 0.0 ? &scale : nullptr;
  int status = 0;
  if (eight) {
    size_t done = 0;
    for_each_launch<7, kAdam8Tensors>(lists, numels, steps, [&](const Adam8Table& table, int blocks) {
      Adam8Salts s{};
      for (int k = 0; k < table.num_tensors; ++k) s.salt[k] = salts[done + static_cast<size_t>(k)];
      done += static_cast<size_t>(table.num_tensors);
      emu_launch(static_cast<unsigned>(blocks), kAdam8Threads,
                 [&] { adam8_kernel<P, G>(table, s, h, nullptr, scale_ptr, nullptr, &status); });
    });
  } else {
    for_each_launch<5, 56>(lists, numels, steps, [&](const AdamTable& table, int blocks) {
      emu_launch(static_cast<unsigned>(blocks), kAdamThreads,
                 [&] { adam_kernel<P, G>(table, h, nullptr, scale_ptr, nullptr, &status); });
    });
  }
  if (status != 0) return 7;
  for (size_t i = 0; i < count; ++i) {
    Tensor& t = ts[i];
    const std::string at = std::to_string(i);
    bool ok = store(dir + "/p" + at, t.p) && store(dir + "/m" + at, t.m) && store(dir + "/v" + at, t.v);
    if (master) ok = ok && store(dir + "/w" + at, t.w);
    if (eight) ok = ok && store(dir + "/ms" + at, t.ms) && store(dir + "/vs" + at, t.vs);
    if (!ok) return 3;
  }
  return 0;
}

template <class P>
int run_grad(bool eight, const std::string& g, const std::string& dir) {
  if (g == "f32") return run<P, float>(eight, dir);
  if (g == "bf16") return run<P, effmem::bf16_t>(eight, dir);
  if (g == "f16") return run<P, effmem::f16_t>(eight, dir);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s adam|adam8 PDTYPE GDTYPE DIR (see the top of adam_kernels.cpp)\n", argv[0]);
    return 1;
  }
  const std::string op = argv[1], p = argv[2];
  if (op != "adam" && op != "adam8") return 1;
  const bool eight = op == "adam8";
  if (p == "f32") return run_grad<float>(eight, argv[3], argv[4]);
  if (p == "bf16") return run_grad<effmem::bf16_t>(eight, argv[3], argv[4]);
  if (p == "f16") return run_grad<effmem::f16_t>(eight, argv[3], argv[4]);
  return 1;
}
