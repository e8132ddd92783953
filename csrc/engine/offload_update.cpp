// The offload engine's updates: queueing and running the Adam update of a
// bucket, installing delayed weights, and step / zero_grad / synchronize.
// Construction, the workers and views are in offload_engine.cpp, the gradient hand-over in offload_grads.cpp.
#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "cpu/dispatch.h"
#include "engine/offload_engine.h"

namespace effmem::engine {

// ------------------------------------------------------------------ updates

void OffloadEngine::queue_update_locked(int64_t bucket, std::vector<int64_t> ids, double grad_scale,
                                        bool predict) {
  if (ids.empty()) return;
  // The update waits for the copies that filled the staging, and for the
  // last upload that read the host memory it is about to overwrite.
  std::vector<TicketPtr> waits;
  auto done = std::make_shared<std::promise<void>>();
  std::shared_future<void> updated = done->get_future().share();
  for (int64_t j : ids) {
    Param& p = params_[static_cast<size_t>(j)];
    if (p.staged) waits.push_back(p.staged);
    for (const TicketPtr& t : p.uploaded) {
      if (t) waits.push_back(t);
    }
    if (p.ahead_uploaded) waits.push_back(p.ahead_uploaded);  // delay_correction: the prediction's last reader
    p.has_grad = false;
    p.queued = true;
    if (options_.delay) {
      // Supersedes weights still pending from an earlier step, if any.
      p.pending_upload = true;
      p.predictable = predict && options_.delay_correction;
      p.pending_side = side_;
      p.updated = updated;
    }
  }
  // Hyper-parameters as they are now: in delay and overlap mode the update
  // runs while Python may already be changing them for the next step.
  int64_t adds_before;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    adds_before = adds_lane_.queued;
  }
  enqueue(updates_lane_, [this, bucket, ids = std::move(ids), grad_scale, waits = std::move(waits),
                          hparams = groups_, done, side = side_, adds_before, predict] {
    // The error is recorded before `updated` is signalled, so that whoever
    // waited for it sees the failure and installs nothing.
    try {
      {
        // The gradients added into this update's staging (adds never wait
        // for updates, so this cannot deadlock).
        std::unique_lock<std::mutex> lock(qmu_);
        idle_cv_.wait(lock, [&] { return adds_lane_.done >= adds_before; });
      }
      run_update(bucket, ids, grad_scale, waits, hparams, side, predict);
    } catch (...) {
      record_error(std::current_exception());
    }
    done->set_value();
  });
}

void OffloadEngine::run_update(int64_t bucket, const std::vector<int64_t>& ids, double grad_scale,
                               const std::vector<TicketPtr>& waits, const std::vector<GroupHparams>& hparams,
                               int side, bool predict) {
  std::string fail;
  int64_t fail_delay_ms = 0;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    if (error_) return;  // already failed: leave the state as it was at the failure
    if (!fail_message_.empty() && fail_after_-- == 0) {
      std::swap(fail, fail_message_);
      fail_delay_ms = fail_delay_ms_;
    }
  }
  if (!fail.empty()) {  // the delay outside the lock: the backward's hooks take it too
    std::this_thread::sleep_for(std::chrono::milliseconds(fail_delay_ms));
    throw std::runtime_error(fail);
  }
  for (const TicketPtr& t : waits) t->wait();
  const Bucket& b = buckets_[static_cast<size_t>(bucket)];
  const bool low_precision = b.dtype != cpu::kF32;
  const int64_t esize = element_size(b.dtype);
  const cpu::AdamFn fn = cpu::kernels().adam[b.dtype][b.dtype];
  const cpu::Adam8Fn fn8 = cpu::kernels().adam8[b.dtype][b.dtype];
  const bool eight = options_.state_bits == 8;
  float* steps = static_cast<float*>(steps_->data());
  struct Work {
    cpu::AdamSpan span;
    cpu::Adam8Span span8;
    int64_t n;
    size_t coeff;
  };
  std::vector<AdamCoeffs> coeffs;
  std::vector<DelayPrediction> predictions;   // delay_correction: per parameter, as coeffs
  char* ahead = predict && options_.delay_correction ? static_cast<char*>(b.ahead->data()) : nullptr;
  std::vector<Work> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t j : ids) {
      const Param& p = params_[static_cast<size_t>(j)];
      const GroupHparams& h = hparams[static_cast<size_t>(p.group)];
      steps[j] += 1.0f;
      coeffs.push_back(adam_coeffs(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled,
                                   h.bias_correction, steps[j], grad_scale));
      if (ahead != nullptr) {   // the install's correction is this update's too (its hyper-parameters, scale)
        const DelayCoeffs d = delay_coeffs(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled,
                                           h.bias_correction, steps[j], grad_scale);
        predictions.push_back(d.predict);
        params_[static_cast<size_t>(j)].correction = d.correct;
      }
      char* stage = staging_of(p, side);
      float* master = static_cast<float*>(b.master->data()) + p.offset;
      for (int64_t off = 0; off < p.numel; off += cpu::kAdamSpan) {
        // The new low-precision weights overwrite the gradient in place:
        // each element's gradient is read before its weight is written.
        char* g = stage + off * esize;
        Work w{};
        w.n = std::min(cpu::kAdamSpan, p.numel - off);
        w.coeff = coeffs.size() - 1;
        // delay_correction: the update also writes the next step's prediction into bucket.ahead (the
        // DelayPrediction's address is set below, once `predictions` stops growing)
        const cpu::DelayOut out = ahead == nullptr ? cpu::DelayOut{} : cpu::DelayOut{
            ahead + (p.offset + off) * esize, ahead + (b.numel + p.offset + off) * esize, nullptr};
        if (eight) {
          // Spans start on 8-bit blocks (kAdamSpan is a multiple of kAdam8Block); the salt is the
          // parameter's place in the optimizer, as FusedAdam's.
          const int64_t blk = p.block_offset + off / kAdam8Block;
          const int64_t salt = options_.salt_base + j;
          w.span8 = {g, g, master + off,
                     static_cast<uint8_t*>(b.exp_avg->data()) + p.offset + off,
                     static_cast<uint8_t*>(b.exp_avg_sq->data()) + p.offset + off,
                     static_cast<float*>(b.exp_avg_scale->data()) + blk,
                     static_cast<float*>(b.exp_avg_sq_scale->data()) + blk, static_cast<uint64_t>(off),
                     adam8_seed(steps[j], salt, false), adam8_seed(steps[j], salt, true), out};
        } else {
          w.span = {g, g, master + off, static_cast<float*>(b.exp_avg->data()) + p.offset + off,
                    static_cast<float*>(b.exp_avg_sq->data()) + p.offset + off, out};
        }
        work.push_back(w);
      }
    }
  }
  if (ahead != nullptr) {
    for (Work& w : work) w.span.delay.c = w.span8.delay.c = &predictions[w.coeff];
  }
  pool_->run(static_cast<int64_t>(work.size()), [&](int64_t k) {
    if (eight) {
      fn8(work[k].span8, work[k].n, coeffs[work[k].coeff]);
    } else {
      fn(work[k].span, work[k].n, coeffs[work[k].coeff]);
    }
  });
  updates_ += static_cast<int64_t>(ids.size());
  if (options_.delay) return;  // uploaded by install(), during the next backward
  TicketPtr last;
  for (int64_t j : ids) {
    const Param& p = params_[static_cast<size_t>(j)];
    if (p.numel == 0) continue;
    const void* src = low_precision ? static_cast<const void*>(staging_of(p, side))
                                    : static_cast<const void*>(static_cast<float*>(b.master->data()) + p.offset);
    last = transfer_->upload(src, p.tensor, p.numel * esize);
    bytes_up_ += p.numel * esize;
  }
  if (last) {
    // The next gradient copied into this bucket waits for these uploads (its
    // staging, or for fp32 its master, is what they read).
    std::lock_guard<std::mutex> lock(mu_);
    buckets_[static_cast<size_t>(bucket)].last_upload = last;
  }
}

void OffloadEngine::install(int64_t i, const at::Tensor* grad) {
  Param& p = params_[static_cast<size_t>(i)];
  std::shared_future<void> updated;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!installable(p, grad)) return;
    updated = p.updated;
  }
  updated.wait();  // normally long done: it ran during this forward and backward
  check_installable();  // a failed update left no weights to install
  std::lock_guard<std::mutex> lock(mu_);
  if (installable(p, grad)) {
    upload_pending_locked(p, grad);
    ++installed_since_step_;
    // async_step installs at the owning module's forward. A read of the old weights earlier in this forward
    // (a functional call) that autograd saved for backward is then refused there by its in-place check, as for
    // torch's own in-place writes; the copy itself writes the memory behind autograd's back.
    if (options_.install_in_forward) p.tensor.unsafeGetTensorImpl()->bump_version();
  }
}

void OffloadEngine::check_installable() {
  // Each install waits for its own bucket's update only (waiting for the whole step's would hold the
  // backward until the last bucket's update is done), so a later bucket's failure can come after
  // earlier buckets went up: say so rather than imply that nothing was installed. (A closed or forked
  // engine is check_usable's own message.)
  if (closed_ || forked()) check_usable();
  try {
    check_usable();
  } catch (const std::exception& e) {
    int64_t installed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      installed = installed_since_step_;
    }
    if (installed == 0) throw;
    throw std::runtime_error(std::string(e.what()) + " (after " + std::to_string(installed) +
                             " parameters had received that step's new weights, their buckets' updates having "
                             "finished first: the model holds part of a step; restore its weights and the "
                             "optimizer from a checkpoint)");
  }
}

void OffloadEngine::install_for_forward(const std::vector<int64_t>& ids) {
  check_usable();
  for (int64_t i : ids) {
    TORCH_CHECK_INDEX(i >= 0 && i < static_cast<int64_t>(params_.size()), "OffloadEngine.install_for_forward: "
                      "index ", i, " out of range");
    install(i);
  }
  transfer_->fence();
}

void OffloadEngine::upload_pending_locked(Param& p, const at::Tensor* grad) {
  const int64_t esize = element_size(p.dtype);
  if (p.numel == 0) {
    p.pending_upload = p.predictable = false;
    return;
  }
  const Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
  if (grad != nullptr && p.predictable) {
    // The prediction instead of the new weights; the new weights stay in the staging for a flush.
    const char* ahead = static_cast<const char*>(b.ahead->data());
    p.ahead_uploaded = transfer_->upload_corrected(ahead + p.offset * esize, ahead + (b.numel + p.offset) * esize,
                                                   p.tensor, *grad, p.numel * esize, p.correction);
    p.pending_upload = p.predictable = false;
    p.predicted = true;
    bytes_up_ += 2 * p.numel * esize;
    return;
  }
  p.predicted = false;
  const void* src = p.dtype != cpu::kF32 ? static_cast<const void*>(staging_of(p, p.pending_side))
                                         : static_cast<const void*>(static_cast<float*>(b.master->data()) + p.offset);
  // After the parameter's last readers. Installed during backward (delay), those are the kernels queued
  // so far. Installed in the forward (async_step), they are the last step's, all queued before step()
  // recorded them (record_readers): waiting for the forward's own kernels up to this module would keep
  // every upload from overlapping the compute before it.
  p.uploaded[p.pending_side] = transfer_->upload(src, p.tensor, p.numel * esize,
                                                 /*after_current_stream=*/!options_.install_in_forward);
  p.pending_upload = false;  // only once the copy is issued: a failed one stays pending
  bytes_up_ += p.numel * esize;
}

void OffloadEngine::step(double grad_scale, bool predict) {
  check_usable();
  transfer_->record_readers();
  if (options_.delay) {
    // Every weight still pending goes up before the next update is queued
    // (else that update would supersede it, and it would never go up): those
    // of parameters without a gradient in this step, or whose gradients all
    // came inside accumulating(). Always here, not "if already done", so the
    // weights a step sees never depend on thread timing. install() waits for
    // the update (normally long done) and checks for an error after the wait.
    std::vector<int64_t> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < params_.size(); ++i) {
        if (params_[i].pending_upload) pending.push_back(static_cast<int64_t>(i));
      }
    }
    for (int64_t i : pending) install(i);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A prediction is for its parameter's next update: this step's updates make new ones (queue_update_locked),
    // and a parameter without a gradient in this step keeps its own (its state is the update's that wrote it).
    const size_t nb = buckets_.size();
    for (size_t k = 0; k < nb; ++k) {
      // Buckets follow backward order; when the next forward installs the weights, the update
      // runs in its order instead: the first layers' buckets first.
      const size_t b = options_.install_in_forward ? nb - 1 - k : k;
      std::vector<int64_t> ready;
      for (int64_t j : buckets_[b].params) {
        const Param& p = params_[static_cast<size_t>(j)];
        if (p.has_grad && !p.queued) ready.push_back(j);
      }
      queue_update_locked(static_cast<int64_t>(b), std::move(ready), grad_scale, predict);
    }
    if (options_.delay) {
      for (Param& p : params_) p.queued = p.landed = p.predicted = false;
      prediction_replaced_ = false;
      installed_since_step_ = 0;
      side_ ^= 1;  // the next step's gradients land beside the weights being computed
    }
  }
  if (options_.delay) {
    transfer_->fence();  // the next forward reads what this backward installed
    return;
  }
  wait_idle();
  check_usable();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Param& p : params_) p.queued = p.landed = false;
    for (Bucket& b : buckets_) b.landed = 0;
  }
  transfer_->fence();
}

void OffloadEngine::zero_grad() {
  check_usable();
  if (options_.delay) {
    // Right after step() no gradient is pending, and the updates in flight
    // must keep running (their weights are installed later): nothing to
    // drop, nothing to wait for.
    std::lock_guard<std::mutex> lock(mu_);
    bool any = false;
    for (const Param& p : params_) any = any || p.has_grad;
    if (!any) return;
  }
  wait_idle();
  wait_staged();
  if (options_.delay_correction) {
    // Predictions made from the gradients dropped here give way to the update's own weights, and the next
    // backward predicts again.
    std::lock_guard<std::mutex> lock(mu_);
    for (Param& p : params_) {
      if (p.predicted) {
        upload_pending_locked(p);
        p.predictable = true;
      }
    }
    prediction_replaced_ = false;   // the gradients it was about go with this zero_grad
  }
  // Overlap mode without step(): updates that ran during backward uploaded
  // weights that the next forward must wait for.
  transfer_->fence();
  std::lock_guard<std::mutex> lock(mu_);
  for (Param& p : params_) {
    p.has_grad = p.queued = p.landed = false;
    p.staged = nullptr;
  }
  for (Bucket& b : buckets_) b.landed = 0;
}

void OffloadEngine::wait_updates() {
  check_usable();
  wait_idle();
  check_usable();  // a failed update: raised here, as synchronize() raises it
}

std::vector<int64_t> OffloadEngine::synchronize() {
  check_usable();
  wait_idle();
  wait_staged();
  std::vector<int64_t> written;
  if (options_.delay) {
    check_usable();  // install nothing from a failed update
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      prediction_replaced_ = prediction_replaced_ || p.predicted;
      if (p.pending_upload || p.predicted) {
        upload_pending_locked(p);
        if (p.numel > 0) written.push_back(static_cast<int64_t>(i));
      }
    }
  }
  transfer_->wait_uploads();  // Python may write the host state next (load_state_dict)
  check_usable();
  return written;
}

void OffloadEngine::discard_pending() {
  check_usable();
  wait_idle();
  wait_staged();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Param& p : params_) p.pending_upload = p.predictable = p.predicted = false;
  }
  transfer_->wait_uploads();  // the host state is written next
  check_usable();
}

}  // namespace effmem::engine
