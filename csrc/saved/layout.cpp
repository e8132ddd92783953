// Where a saved tensor's elements lie, which decides whether and how the store (store.cpp) compresses it: a
// dense tensor in memory order, a view with gaps through the dense tensor it views (in groups that stay within
// its runs), an overlapping one kept as it is. effmem plan's trace asks the same rule (layout_kept).
#include "saved/saved.h"

#include <algorithm>
#include <numeric>

namespace effmem::saved {
namespace {

// (enum class: SavedTensors::Reason has a kOverlapping of its own)
enum class Layout { kDense, kStrided, kOverlapping };

Layout classify(const at::Tensor& t) {
  if (t.is_contiguous()) return Layout::kDense;
  auto sizes = t.sizes();
  auto strides = t.strides();
  std::vector<int64_t> order(sizes.size());  // outermost to innermost in memory; ties keep dim order
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  int64_t expected = 1;
  bool dense = true;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int64_t d = *it;
    if (sizes[d] == 1) continue;  // never moves the pointer: its stride says nothing
    if (strides[d] < expected) return Layout::kOverlapping;  // two indices reach one element
    if (strides[d] != expected) dense = false;
    expected = strides[d] * sizes[d];
  }
  return dense ? Layout::kDense : Layout::kStrided;
}

}  // namespace

// The length of a dense tensor's rows in memory, what its quantisation groups stay within: the last dim of a
// contiguous one (even of size 1: a norm's [tokens, 1] statistics are rows of one), else the dim it walks with
// stride 1 (a transposed key [b, h, d, s] is rows of d, one per token, not of s).
int64_t memory_row(const at::Tensor& t) {
  if (t.dim() == 0 || t.numel() == 0) return std::max<int64_t>(t.numel(), 1);
  if (t.is_contiguous()) return std::max<int64_t>(t.size(-1), 1);
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.size(d) > 1 && t.stride(d) == 1) return t.size(d);
  }
  return t.numel();
}

namespace {

// A view of a tensor wider than this many times its size is kept rather than compressed through it.
constexpr int64_t kMaxBaseGrowth = 4;

// The group size for a view `t` with gaps compressed through its dense `base` (rows of d in memory): one that
// no group of the base's memory straddles a run of t's elements and a run of elements t does not see, so that
// the values around the view (another head's, an inf) never set its groups' scale. A run: t's dim of stride 1
// and the dims that continue it in memory (q of a fused qkv viewed as [tokens, heads, head_dim]: heads x
// head_dim). A view of whole rows takes the rows' rule (0 here); else the largest supported size up to
// `limit` dividing t's offset in the base, its runs' length and its other strides (-1: none, or t has no
// run of stride 1: it is kept).
int64_t view_group(const at::Tensor& t, const at::Tensor& base, int64_t d, int64_t limit) {
  const int64_t dims = t.dim();
  std::vector<bool> in_run(dims, false);
  int64_t run = 0;
  for (int64_t k = dims - 1; k >= 0 && run == 0; --k) {
    if (t.size(k) > 1 && t.stride(k) == 1) {
      in_run[k] = true;
      run = t.size(k);
    }
  }
  if (run == 0) return -1;
  for (bool grew = true; grew;) {  // the dims whose stride is the run so far extend it
    grew = false;
    for (int64_t k = 0; k < dims; ++k) {
      if (!in_run[k] && t.size(k) > 1 && t.stride(k) == run) {
        in_run[k] = true;
        run *= t.size(k);
        grew = true;
      }
    }
  }
  const int64_t rel = t.storage_offset() - base.storage_offset();
  int64_t common = std::gcd(std::gcd(d, rel), run);
  bool whole_rows = run % d == 0 && rel % d == 0;
  for (int64_t k = 0; k < dims; ++k) {
    if (in_run[k] || t.size(k) == 1) continue;
    common = std::gcd(common, t.stride(k));
    whole_rows = whole_rows && t.stride(k) % d == 0;
  }
  if (whole_rows) return 0;
  for (int64_t g = limit; g >= 32; g /= 2) {
    if (common % g == 0) return g;
  }
  return -1;
}

}  // namespace

std::optional<SavedTensors::Reason> SavedTensors::layout_keeps(const at::Tensor& t, int64_t group_size,
                                                               at::Tensor& src, int64_t& aligned) {
  if (t.is_nested() || t.layout() != at::kStrided) return kUnsupported;
  const Layout layout = classify(t);
  if (layout == Layout::kOverlapping) return kOverlapping;
  src = t;
  aligned = 0;
  if (layout != Layout::kDense) {
    if (!t.is_view()) return kStridedView;
    const at::Tensor base(t._base());
    if (classify(base) != Layout::kDense || base.numel() > kMaxBaseGrowth * t.numel() ||
        base.scalar_type() != t.scalar_type()) {
      return kStridedView;
    }
    src = base;
    if (t.scalar_type() != at::kBool) aligned = view_group(t, src, memory_row(src), group_size);   // bools: exact
    if (aligned < 0) return kStridedView;
  }
  return std::nullopt;
}

py::object SavedTensors::layout_kept(const at::Tensor& t, int64_t group_size) {
  at::Tensor src;
  int64_t aligned = 0;
  const std::optional<Reason> why = layout_keeps(t, group_size, src, aligned);
  if (!why) return py::none();
  return py::str(kReasons[*why]);
}

}  // namespace effmem::saved
