// delay_correction's host half: after a bucket's update, the prediction of the next step's weights
// (common/delay_correction_math.h) into bucket.ahead; and the device half as the host backend runs it.
#include <c10/util/Exception.h>

#include <cmath>

#include "common/adam8_math.h"
#include "common/delay_correction_math.h"
#include "common/storage.h"
#include "cpu/dispatch.h"
#include "engine/delay_correction.h"
#include "engine/offload_engine.h"

namespace effmem::engine {
namespace {

template <class T>
void predict_typed(const float* w, const float* m, const float* v, const uint8_t* m8, const uint8_t* v8,
                   const float* m_scale, const float* v_scale, int64_t first_block_element, int64_t n,
                   const DelayPrediction& c, T* pred, DelayR<T>* r) {
  for (int64_t i = 0; i < n; ++i) {
    float mi, vi;
    if (m8 != nullptr) {  // 8-bit moments: decoded as the next update will decode them
      const int64_t blk = (first_block_element + i) / kAdam8Block;
      mi = adam8_decode_m(m8[i], m_scale[blk]);
      vi = adam8_decode_v(v8[i], v_scale[blk]);
    } else {
      mi = m[i];
      vi = v[i];
    }
    float p, q;
    delay_predict(w[i], mi, vi, c, round_to<DelayR<T>>, &p, &q);
    store_float(pred + i, round_to<T>(p));
    store_float(r + i, q);
  }
}

template <class T>
void correct_typed(T* w, const DelayR<T>* r, const T* g, int64_t n, const DelayCorrection& c) {
  for (int64_t i = 0; i < n; ++i) {
    store_float(w + i, round_to<T>(delay_correct(load_as_float(w + i), load_as_float(r + i),
                                                 load_as_float(g + i), c)));
  }
}

}  // namespace

void OffloadEngine::predict_span(const Param& p, int64_t off, int64_t n, const GroupHparams& h,
                                 float step) const {
  const Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
  const DelayPrediction c = delay_prediction(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled,
                                             h.bias_correction, step);
  const int64_t at = p.offset + off;
  const float* w = static_cast<const float*>(b.master->data()) + at;
  const bool eight = options_.state_bits == 8;
  const float* m = eight ? nullptr : static_cast<const float*>(b.exp_avg->data()) + at;
  const float* v = eight ? nullptr : static_cast<const float*>(b.exp_avg_sq->data()) + at;
  const uint8_t* m8 = eight ? static_cast<const uint8_t*>(b.exp_avg->data()) + at : nullptr;
  const uint8_t* v8 = eight ? static_cast<const uint8_t*>(b.exp_avg_sq->data()) + at : nullptr;
  // The block scales from the parameter's first block; element `off` of it is (block_offset * 256 + off)
  // counted from there, so the block of its element i is (off + i) / 256.
  const float* ms = eight ? static_cast<const float*>(b.exp_avg_scale->data()) + p.block_offset : nullptr;
  const float* vs = eight ? static_cast<const float*>(b.exp_avg_sq_scale->data()) + p.block_offset : nullptr;
  char* ahead = static_cast<char*>(b.ahead->data());
  const int64_t esize = element_size(p.dtype);
  void* pred = ahead + at * esize;
  void* r = ahead + (b.numel + at) * esize;
  switch (p.dtype) {
    case cpu::kF32:
      return predict_typed(w, m, v, m8, v8, ms, vs, off, n, c, static_cast<float*>(pred), static_cast<float*>(r));
    case cpu::kBF16:
      return predict_typed(w, m, v, m8, v8, ms, vs, off, n, c, static_cast<bf16_t*>(pred), static_cast<bf16_t*>(r));
    default:
      return predict_typed(w, m, v, m8, v8, ms, vs, off, n, c, static_cast<f16_t*>(pred), static_cast<bf16_t*>(r));
  }
}

void correct_on_host(void* w, const void* r, const void* g, int64_t n, at::ScalarType dtype,
                     const DelayCorrection& c) {
  switch (dtype) {
    case at::kFloat:
      return correct_typed(static_cast<float*>(w), static_cast<const float*>(r), static_cast<const float*>(g), n, c);
    case at::kBFloat16:
      return correct_typed(static_cast<bf16_t*>(w), static_cast<const bf16_t*>(r), static_cast<const bf16_t*>(g),
                           n, c);
    case at::kHalf:
      return correct_typed(static_cast<f16_t*>(w), static_cast<const bf16_t*>(r), static_cast<const f16_t*>(g), n,
                           c);
    default:
      TORCH_CHECK_TYPE(false, "delay_correction: parameters must be float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace effmem::engine
