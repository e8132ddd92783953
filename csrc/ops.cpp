// Every effmem op schema, defined once. Implementations register per device
// (cpu/*.cpp, cuda/*.cu); fake (meta) implementations for torch.compile live
// in python/effmem/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(effmem, m) {
  // One Adam/AdamW step over lists of same-dtype tensors on one device.
  // params are updated in place; for bf16/fp16 params `masters` holds their
  // fp32 master weights (updated, then rounded into params), for fp32 params
  // it is empty. steps[i] is param i's step count *after* this step (float32,
  // on the params' device), read on the device so the step can be captured in
  // a CUDA graph; so is lr_tensor when given (it then replaces lr).
  // inv_scale multiplies the gradients; a nonzero found_inf skips the step.
  // A step count that is not a whole number in [1, 2^63), or an lr_tensor that
  // is negative or not finite, is refused: on the CPU the op raises; on CUDA,
  // where reading them would cost a host sync, the kernel leaves the tensors
  // concerned unchanged and ORs into `status` (int32, one element, the params'
  // device) 1 for a refused lr, 2 for a refused step count.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] masters, Tensor[] steps, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool decoupled, bool bias_correction, "
      "Tensor? lr_tensor=None, Tensor? inv_scale=None, Tensor? found_inf=None, Tensor(e!)? status=None) -> ()");
  // The same step with 8-bit moments (common/adam8_math.h): exp_avgs and
  // exp_avg_sqs are uint8 codes laid out as the params, with float32 block
  // scales [ceil(numel / 256)] in exp_avg_scales / exp_avg_sq_scales, decoded,
  // updated and encoded again in one pass; salts[i] (the tensor's place in its
  // optimizer) and the step count seed the stochastic rounding of its codes.
  m.def(
      "adam8_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] exp_avg_scales, Tensor(e!)[] exp_avg_sq_scales, Tensor(f!)[] masters, Tensor[] steps, "
      "int[] salts, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
      "bool bias_correction, Tensor? lr_tensor=None, Tensor? inv_scale=None, Tensor? found_inf=None, "
      "Tensor(g!)? status=None) -> ()");
  // The checks of adam_step_ (exp_avg_scales empty) or adam8_step_ over the same lists, writing nothing:
  // FusedAdam runs them over every call of a step before the first, so that a refused step changes nothing.
  m.def(
      "adam_check(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor[] masters, "
      "Tensor[] steps, Tensor[] exp_avg_scales, Tensor[] exp_avg_sq_scales) -> ()");
  // A checkpoint's moments to 8-bit ones and back, as adam8_step_ encodes and
  // decodes them (CPU only; python/effmem/optim/_adam8.py does the same in
  // torch ops elsewhere): m and v, float32 [n], into (m codes, v codes, m
  // scales, v scales), rounded with the seeds of `step` and `salt`; and one
  // moment's codes and scales (second: v's) into float32 [n].
  m.def("adam8_encode(Tensor m, Tensor v, float step, int salt) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("adam8_decode(Tensor codes, Tensor scales, bool second) -> Tensor");
  // Global L2 norm of a list of floating tensors on one device, as a float32
  // scalar on that device (sums of squares accumulated in float per block and
  // in double across blocks).
  m.def("l2norm(Tensor[] tensors) -> Tensor");
  // Group-wise quantisation along the last dimension (common/quant_math.h).
  // x: float32/bf16/fp16, contiguous, viewed as [rows, D]. Returns codes
  // (uint8 [rows, ceil(D * bits / 8)]; at 4 bits two per byte, low nibble
  // first) and stats (float32 [rows, ceil(D / group_size), 2] = (min, scale)).
  // bits: 4 or 8; group_size: 32, 64, 128 or 256. stochastic rounding draws
  // from a hash of (seed, element index): the same codes on every device.
  m.def("quantize(Tensor x, int bits, int group_size, int seed, bool stochastic) -> (Tensor, Tensor)");
  // Fused linear cross-entropy (common/linear_ce_math.h): the loss of
  // cross_entropy(hidden @ weight.T + bias, target) per token (float32 [N], 0
  // for ignore_index) and each token's log-sum-exp, without ever holding the
  // [N, V] logits: they are made one vocabulary chunk of vocab_chunk entries
  // at a time (0: 1/64 of the vocabulary, at most 128 MB of float32 logits). softcap 0: none.
  m.def(
      "linear_ce_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
      "float label_smoothing, float softcap, int vocab_chunk) -> (Tensor, Tensor)");
  // Its gradients with respect to hidden, weight and bias for grad_loss [N]
  // (the incoming gradient of each token's loss), recomputing the logits chunk
  // by chunk; an output whose output_mask entry is false comes back empty. target and lse as the forward
  // checked and made them (not checked again here).
  m.def(
      "linear_ce_backward(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor lse, int ignore_index, float label_smoothing, float softcap, int vocab_chunk, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // Loss and gradients at once, for incoming gradients grad_scale [N] (float32) known before backward (a
  // mean or sum; 0 for a token whose target is ignore_index: the kernels apply each token's scale as it
  // is, as linear_cross_entropy makes them): the logits are made one chunk of token_chunk tokens' whole
  // rows at a time (0: 1/32 of the tokens, at least 128, at most 128 MB of float32 logits), three matrix
  // products instead of the four of forward plus backward. Returns (loss [N], grad hidden, grad weight,
  // grad bias), empty where output_mask is false; the weight gradient is summed in float32 (in its own
  // memory for a float32 weight, in a float32 buffer rounded once for a bf16/fp16 one).
  m.def(
      "linear_ce_forward_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor grad_scale, "
      "int ignore_index, float label_smoothing, float softcap, int token_chunk, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // SwiGLU, silu(gate) * up, and its gradients (grad_gate, grad_up) for the incoming gradient grad
  // (common/swiglu_math.h): float32, bfloat16 or float16 tensors of one shape and dtype; results
  // contiguous, rounded as the torch ops they replace round (F.silu, then the product): bf16 and fp16
  // results equal theirs, float32 ones may differ in the last place (e^x is computed, not libm's).
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  // weight * (x * rstd) with rstd (float32) one value per row of x, rounded as Hugging Face's RMSNorm
  // rounds it (common/rms_norm_math.h): the elementwise end of that norm in one pass.
  m.def("rms_norm_apply(Tensor x, Tensor rstd, Tensor weight) -> Tensor");
  // The inverse: a contiguous [rows, last_dim] tensor of dtype.
  m.def(
      "dequantize(Tensor codes, Tensor stats, int bits, int group_size, int last_dim, ScalarType dtype) "
      "-> Tensor");
}
