// Random tensor lists through for_each_launch: every chunk of every non-empty
// tensor is covered by exactly one block, blocks are numbered consecutively
// across launches, and each block finds its tensor's pointers and size.
#include "cuda/multi_tensor.cuh"
#include <cstdio>
#include <map>
#include <random>
using namespace effmem::cuda;
int main() {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    int nt = rng() % 300;
    std::vector<std::vector<void*>> lists(2);
    std::vector<int64_t> numels;
    for (int t = 0; t < nt; ++t) {
      int64_t n = (rng() % 4 == 0) ? 0 : (rng() % 5 == 0 ? rng() % (kChunk * 40) : rng() % 100 + 1);
      numels.push_back(n);
      lists[0].push_back((void*)(intptr_t)(t + 1));
      lists[1].push_back((void*)(intptr_t)(1000000 + t));
    }
    std::map<std::pair<int, int64_t>, int> seen;
    int64_t global = 0; bool ok = true;
    for_each_launch<2, 7>(lists, numels, {}, [&](const TensorTable<2, 7>& tb, int blocks) {
      if (tb.first_block != global || tb.num_tensors < 1 || tb.num_tensors > 7) ok = false;
      if (tb.block_end[tb.num_tensors - 1] != blocks) ok = false;
      for (int b = 0; b < blocks; ++b) {
        int s;
        int64_t chunk;
        tb.locate(b, &s, &chunk);
        int t = (int)(intptr_t)tb.ptr[0][s] - 1;
        if ((intptr_t)tb.ptr[1][s] != 1000000 + t || tb.numel[s] != numels[t]) ok = false;
        if (chunk < 0 || chunk * kChunk >= numels[t]) ok = false;
        seen[{t, chunk}]++;
      }
      global += blocks;
    });
    int64_t expect = 0;
    for (int t = 0; t < nt; ++t) for (int64_t c = 0; c < (numels[t] + kChunk - 1) / kChunk; ++c) { expect++; if (seen[{t, c}] != 1) ok = false; }
    if (!ok || expect != global) { printf("FAIL trial %d\n", trial); return 1; }
  }
  printf("ok\n");
}
