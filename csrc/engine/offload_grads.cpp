// The offload engine's gradient hand-over: each gradient copied to the host as
// backward makes it (grad_ready), later ones of an accumulation added through
// the landing chunks, the clip norm's sums of squares, and the stream orders
// around the copies. Construction and lifetime are in offload_engine.cpp.
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "common/checks.h"
#include "cpu/dispatch.h"
#include "engine/offload_engine.h"

namespace effmem::engine {

int OffloadEngine::acquire_chunk() {
  std::unique_lock<std::mutex> lock(qmu_);
  chunk_cv_.wait(lock, [&] { return stop_ || !free_chunks_.empty(); });
  TORCH_CHECK(!stop_, "OffloadAdam: the offload engine is closed");
  const int c = free_chunks_.back();
  free_chunks_.pop_back();
  return c;
}

void OffloadEngine::release_chunk(int c) {
  {
    std::lock_guard<std::mutex> lock(qmu_);
    free_chunks_.push_back(c);
  }
  chunk_cv_.notify_one();
}

// ------------------------------------------------------------------ gradients

char* OffloadEngine::staging_of(const Param& p, int side) const {
  const Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
  return static_cast<char*>(b.staging[side]->data()) + p.offset * element_size(p.dtype);
}

void OffloadEngine::grad_ready(int64_t i, const at::Tensor& grad) {
  check_usable();
  TORCH_CHECK_INDEX(i >= 0 && i < static_cast<int64_t>(params_.size()), "OffloadEngine.grad_ready: index ", i,
                    " out of range for ", params_.size(), " parameters");
  Param& p = params_[static_cast<size_t>(i)];
  TORCH_CHECK_TYPE(grad.scalar_type() == p.tensor.scalar_type(), "grad of parameter ", i, ": expected ",
                   p.tensor.scalar_type(), ", got ", grad.scalar_type());
  TORCH_CHECK_VALUE(grad.device() == p.tensor.device() && grad.sizes() == p.tensor.sizes() &&
                        grad.strides() == p.tensor.strides(),
                    "grad of parameter ", i, ": expected the parameter's device, shape and strides (",
                    p.tensor.device(), ", ", p.tensor.sizes(), ", ", p.tensor.strides(), "), got ", grad.device(),
                    ", ", grad.sizes(), ", ", grad.strides());
  const int64_t bytes = p.numel * element_size(p.dtype);
  if (options_.install_in_forward) {
    bool pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending = p.pending_upload;
    }
    TORCH_CHECK(!pending, "OffloadAdam(async_step=True): parameter ", i, " got a gradient, but its new weights "
                "were never installed: the forward read it before its update, outside the forward of a module "
                "given to attach() that owns it (a functional call, a parameter shared across modules). Use "
                "it through such a module, or call opt.flush() before the forward");
  } else if (options_.delay) {
    // Backward is done with this parameter, so its pending weights may go up:
    // they do in the last micro-batch (outside accumulating()), so that every
    // micro-batch of a step runs on the same weights; and they must before a
    // gradient lands in the staging that holds them.
    bool now, whole, move;
    TicketPtr reader;
    {
      std::lock_guard<std::mutex> lock(mu_);
      whole = !accumulating_ && !p.has_grad;  // this gradient is the step's whole gradient
      // delay_correction predicts from a whole gradient only (with accumulation on the host, earlier
      // micro-batches' parts are not on the device; device_accumulation hands the sum over here), also
      // after a flush installed the update's own weights.
      now = (p.pending_upload && (!accumulating_ || p.pending_side == side_)) || (whole && p.predictable);
      // A prediction kept over steps without a gradient (an odd number of them) has its update's own weights,
      // which a flush (or a zero_grad after it) installs, in the staging this round's first gradient lands in
      // (also inside accumulating(): the prediction may be made after a zero_grad drops that gradient): they
      // move to the other first. That update is done (it was installed: pending_upload is false).
      move = !p.has_grad && p.predictable && !p.pending_upload && p.pending_side == side_ && p.dtype != cpu::kF32;
      if (move) reader = p.uploaded[side_ ^ 1];
    }
    if (move) {   // outside the lock: an embedding's weights are large; only this thread hands p's gradients over
      if (reader) reader->wait();   // the last upload from the other staging: normally long done
      std::memcpy(staging_of(p, side_ ^ 1), staging_of(p, side_), static_cast<size_t>(bytes));
      std::lock_guard<std::mutex> lock(mu_);
      p.pending_side = side_ ^ 1;
    }
    if (now) install(i, whole ? &grad : nullptr);
  }
  bool accumulate_into_staging, take_sq_sum;
  uint64_t sq_gen;
  TicketPtr staged;
  const char* landed_in;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!p.queued, "OffloadAdam(overlap=True): parameter ", i, " got a second gradient before step(); "
                "its update already ran during backward. Wrap all but the last micro-batch's backward in "
                "`with opt.accumulating():`, or use overlap=False");
    accumulate_into_staging = p.has_grad;
    if (!accumulate_into_staging && bytes > 0) {
      const TicketPtr& after =
          options_.delay ? p.uploaded[side_] : buckets_[static_cast<size_t>(p.bucket)].last_upload;
      p.staged = transfer_->download(grad, 0, staging_of(p, side_), bytes, after);
    }
    p.has_grad = true;
    // A later gradient makes a sum taken before it stale.
    sq_gen = ++p.sq_gen;
    p.sq_ready = false;
    take_sq_sum = eager_sq_ && !accumulating_ && bytes > 0;
    staged = p.staged;
    landed_in = staging_of(p, side_);
  }
  if (accumulate_into_staging && bytes > 0) accumulate(i, grad);
  if (take_sq_sum) queue_sq_sum(i, sq_gen, staged, landed_in);
  bytes_down_ += bytes;
  if (!options_.overlap) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (accumulating_ || p.landed || !p.expects_grad) return;
  p.landed = true;
  Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
  if (++b.landed < b.expected) return;
  std::vector<int64_t> ready;
  for (int64_t j : b.params) {
    if (params_[static_cast<size_t>(j)].has_grad && !params_[static_cast<size_t>(j)].queued) ready.push_back(j);
  }
  queue_update_locked(p.bucket, std::move(ready), 1.0);
}

// A second gradient for a parameter lands chunk by chunk in the landing
// pool; the worker adds each chunk into the staging (in order, after the
// copy that filled the staging), then frees the chunk.
void OffloadEngine::accumulate(int64_t i, const at::Tensor& grad) {
  const Param& p = params_[static_cast<size_t>(i)];
  const int64_t esize = element_size(p.dtype);
  const cpu::AddFn add = cpu::kernels().add[p.dtype];
  TicketPtr staged;
  char* staging;
  {
    std::lock_guard<std::mutex> lock(mu_);
    staged = p.staged;
    staging = staging_of(p, side_);
  }
  const int64_t chunk_numel = options_.landing_chunk_numel;
  for (int64_t off = 0; off < p.numel; off += chunk_numel) {
    const int64_t count = std::min(chunk_numel, p.numel - off);
    const int c = acquire_chunk();
    void* landing = chunks_[static_cast<size_t>(c)]->data();
    TicketPtr landed;
    try {
      landed = transfer_->download(grad, off * esize, landing, count * esize, nullptr);
    } catch (...) {
      release_chunk(c);
      throw;
    }
    enqueue(adds_lane_, [this, c, landed, staged, add, landing, dst = staging + off * esize, count, esize] {
      struct Release {
        OffloadEngine* e;
        int c;
        ~Release() { e->release_chunk(c); }
      } release{this, c};
      landed->wait();
      if (staged) staged->wait();
      // Spread over the pool: a single thread adding 4M elements would hold
      // up the next gradients waiting for a free chunk.
      const char* src = static_cast<const char*>(landing);
      add_pool_->run((count + cpu::kAdamSpan - 1) / cpu::kAdamSpan, [&](int64_t k) {
        const int64_t o = k * cpu::kAdamSpan;
        add(dst + o * esize, src + o * esize, std::min(cpu::kAdamSpan, count - o));
      });
      ++accumulations_;
    });
  }
}

// Clipping by the global norm needs every gradient's sum of squares before the
// update can start: a pass over all of them after backward, on the step's
// critical path (about 20 ms per billion bf16 parameters on 16 cores). Taken
// on the add lane as each final gradient lands, it runs during backward. The
// chunks and the order of additions are grad_sq_sums' own, so the norm is
// bit for bit the same.
void OffloadEngine::queue_sq_sum(int64_t i, uint64_t gen, TicketPtr staged, const char* data) {
  const Param& p = params_[static_cast<size_t>(i)];
  const cpu::SumSqFn fn = cpu::kernels().sumsq[p.dtype];
  const int64_t esize = element_size(p.dtype), n = p.numel;
  // After this gradient's adds (the lane runs in order); a first gradient's copy is waited for here.
  enqueue(adds_lane_, [this, i, gen, staged, data, fn, esize, n] {
    if (staged) staged->wait();
    std::vector<double> partial(static_cast<size_t>((n + cpu::kAdamSpan - 1) / cpu::kAdamSpan));
    add_pool_->run(static_cast<int64_t>(partial.size()), [&](int64_t k) {
      const int64_t o = k * cpu::kAdamSpan;
      partial[static_cast<size_t>(k)] = fn(data + o * esize, std::min(cpu::kAdamSpan, n - o));
    });
    double sum = 0.0;
    for (double s : partial) sum += s;
    std::lock_guard<std::mutex> lock(mu_);
    Param& q = params_[static_cast<size_t>(i)];
    if (q.sq_gen == gen) {
      q.sq_sum = sum;
      q.sq_ready = true;
    }
  });
}

void OffloadEngine::wait_staged() {
  std::vector<TicketPtr> tickets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Param& p : params_) {
      if (p.has_grad && p.staged) tickets.push_back(p.staged);
    }
  }
  for (const TicketPtr& t : tickets) t->wait();
}

std::vector<double> OffloadEngine::grad_sq_sums() {
  check_usable();
  wait_idle();
  check_usable();
  wait_staged();
  struct Work {
    const char* data;
    int64_t n;
    cpu::SumSqFn fn;
    size_t param;
  };
  std::vector<Work> work;
  std::vector<double> sums(params_.size(), 0.0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    eager_sq_ = true;  // the caller clips: later gradients get their sums as they land
    const cpu::KernelTable& table = cpu::kernels();
    for (size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      if (!p.has_grad) continue;
      if (p.sq_ready) {
        sums[i] = p.sq_sum;
        ++landed_sq_sums_;
        continue;
      }
      const char* base = staging_of(p, side_);
      for (int64_t off = 0; off < p.numel; off += cpu::kAdamSpan) {
        work.push_back({base + off * element_size(p.dtype), std::min(cpu::kAdamSpan, p.numel - off),
                        table.sumsq[p.dtype], i});
      }
    }
  }
  std::vector<double> partial(work.size());
  pool_->run(static_cast<int64_t>(work.size()), [&](int64_t k) { partial[k] = work[k].fn(work[k].data, work[k].n); });
  // A fixed order of additions: the result does not depend on the threads.
  for (size_t k = 0; k < work.size(); ++k) sums[work[k].param] += partial[k];
  return sums;
}

void OffloadEngine::order_after_downloads() {
  check_usable();
  transfer_->order_after_downloads();
}

void OffloadEngine::fence() {
  check_usable();
  transfer_->fence();
}

void OffloadEngine::set_accumulating(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  accumulating_ = on;
}

}  // namespace effmem::engine
