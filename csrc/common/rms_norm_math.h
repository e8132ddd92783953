// The elementwise end of Hugging Face's Llama-family RMSNorm, weight * (x * rstd), written once for host
// and device (effmem::rms_norm_apply), with the module's roundings (T: the storage dtype, rT: rounding
// to it; arithmetic in float32):
//   y = rT(w * rT(x * rstd))       rstd: float32, one per row
// which is what `weight * (x.float() * rstd).to(x.dtype)` computes, bit for bit, in three passes over
// float32 temporaries (24 bytes moved per element in bf16); one pass moves 4.
#pragma once

#include "hd.h"
#include "storage.h"

namespace effmem {

template <class T>
EFFMEM_HD float rms_norm_value(float x, float rstd, float w) {
  return round_to<T>(w * round_to<T>(x * rstd));
}

}  // namespace effmem
