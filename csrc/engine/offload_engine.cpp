// The offload engine: construction, lifetime, the two worker lanes and the
// views. The gradient hand-over (grad_ready, accumulation, clip sums) is in
// offload_grads.cpp, the updates and step() in offload_update.cpp.
#include "engine/offload_engine.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/checks.h"
#include "cpu/dispatch.h"

namespace effmem::engine {
namespace {

// Each parameter starts on a 64-byte boundary in every buffer (16 floats,
// 32 bf16): vector loads and streaming stores start aligned.
constexpr int64_t kAlignElems = 32;


// A worker failure, rethrown in every later call so that no caller goes on with half-updated state. The only
// way on is a new optimizer, which the message names (a load_state_dict into this one is refused as well, and a
// new one over the same parameters until this one is closed).
[[noreturn]] void rethrow_worker_error(const std::exception_ptr& e) {
  static const char* const kWayOut =
      " [this optimizer cannot go on: call close() (with delay or async_step it reports this error once more, "
      "and closes), then load the last checkpoint into the model and into a new OffloadAdam]";
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    throw std::runtime_error(std::string("OffloadAdam: the update worker failed: ") + err.what_without_backtrace() +
                             kWayOut);
  } catch (const std::exception& err) {
    throw std::runtime_error(std::string("OffloadAdam: the update worker failed: ") + err.what() + kWayOut);
  }
}

}  // namespace

int64_t OffloadEngine::element_size(int dtype) { return dtype == cpu::kF32 ? 4 : 2; }

OffloadEngine::OffloadEngine(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of,
                             std::vector<int64_t> group_of, std::vector<bool> expects_grad, int64_t num_groups,
                             EngineOptions options)
    : options_(std::move(options)) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(bucket_of.size() == n && group_of.size() == n && expects_grad.size() == n,
                    "OffloadEngine: params, bucket_of, group_of and expects_grad must have the same length");
  TORCH_CHECK_VALUE(num_groups >= 1, "OffloadEngine: num_groups must be >= 1");
  TORCH_CHECK_VALUE(options_.num_threads >= 1, "num_threads must be >= 1, got ", options_.num_threads);
  TORCH_CHECK_VALUE(options_.landing_chunk_numel >= 1 && options_.landing_chunks >= 1,
                    "landing_chunk_numel and landing_chunks must be >= 1");
  TORCH_CHECK_VALUE(!(options_.overlap && options_.delay), "overlap and delay: choose one of the two modes");
  TORCH_CHECK_VALUE(!options_.install_in_forward || options_.delay,
                    "install_in_forward works on delay mode's double staging: pass delay=True too");
  TORCH_CHECK_VALUE(!options_.delay_correction || (options_.delay && !options_.install_in_forward),
                    "delay_correction corrects delay mode's stale gradients: pass delay=True without "
                    "install_in_forward");
  TORCH_CHECK_VALUE(options_.state_bits == 32 || options_.state_bits == 8,
                    "state_bits must be 32 or 8, got ", options_.state_bits);
  if (options_.backend == "host") {
    transfer_ = make_host_transfer(options_.host_delay_us, options_.seed);
  } else if (options_.backend == "cuda") {
    transfer_ = make_cuda_transfer(options_.device);
  } else {
    TORCH_CHECK_VALUE(false, "backend must be 'host' or 'cuda', got '", options_.backend, "'");
  }

  int64_t num_buckets = 0;
  for (int64_t b : bucket_of) num_buckets = std::max(num_buckets, b + 1);
  buckets_.resize(static_cast<size_t>(num_buckets));
  std::vector<bool> bucket_seen(buckets_.size(), false);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = params[i];
    TORCH_CHECK_VALUE(bucket_of[i] >= 0 && group_of[i] >= 0 && group_of[i] < num_groups,
                      "OffloadEngine: bad bucket or group index for param ", i);
    Param p;
    p.tensor = t;
    p.numel = t.numel();
    p.bucket = bucket_of[i];
    p.group = group_of[i];
    p.dtype = dtype_index(t.scalar_type(), "params");
    p.expects_grad = expects_grad[i];
    Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
    if (!bucket_seen[static_cast<size_t>(p.bucket)]) {
      b.dtype = p.dtype;
      bucket_seen[static_cast<size_t>(p.bucket)] = true;
    }
    TORCH_CHECK_VALUE(b.dtype == p.dtype, "OffloadEngine: bucket ", p.bucket, " mixes dtypes");
    p.offset = b.numel;
    b.numel += (p.numel + kAlignElems - 1) / kAlignElems * kAlignElems;
    p.block_offset = b.blocks;
    b.blocks += adam8_blocks(p.numel);
    b.params.push_back(static_cast<int64_t>(i));
    b.expected += p.expects_grad ? 1 : 0;
    params_.push_back(std::move(p));
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TORCH_CHECK_VALUE(bucket_seen[b], "OffloadEngine: bucket ", b, " holds no parameter");
    Bucket& bucket = buckets_[b];
    const int64_t floats = bucket.numel * 4;
    // fp32 parameters are uploaded straight from their master: it must be
    // page-locked for the copy to be asynchronous DMA.
    bucket.master = transfer_->allocate(floats, options_.pin_state || bucket.dtype == cpu::kF32);
    const bool eight = options_.state_bits == 8;
    bucket.exp_avg = transfer_->allocate(eight ? bucket.numel : floats, options_.pin_state);
    bucket.exp_avg_sq = transfer_->allocate(eight ? bucket.numel : floats, options_.pin_state);
    if (eight) {
      bucket.exp_avg_scale = transfer_->allocate(bucket.blocks * 4, options_.pin_state);
      bucket.exp_avg_sq_scale = transfer_->allocate(bucket.blocks * 4, options_.pin_state);
    }
    for (int side = 0; side < (options_.delay ? 2 : 1); ++side) {
      bucket.staging[side] = transfer_->allocate(bucket.numel * element_size(bucket.dtype), true);
    }
    if (options_.delay_correction) {
      bucket.ahead = transfer_->allocate(2 * bucket.numel * element_size(bucket.dtype), true);
    }
  }
  groups_.resize(static_cast<size_t>(num_groups));
  steps_ = allocate_pageable(static_cast<int64_t>(n) * 4);
  for (int64_t c = 0; c < options_.landing_chunks; ++c) {
    chunks_.push_back(transfer_->allocate(options_.landing_chunk_numel * 4, true));
    free_chunks_.push_back(static_cast<int>(c));
  }
  pool_ = std::make_unique<ThreadPool>(options_.num_threads);
  add_pool_ = std::make_unique<ThreadPool>(options_.num_threads);
  updates_lane_.thread = std::thread([this] { worker_loop(updates_lane_); });
  try {
    adds_lane_.thread = std::thread([this] { worker_loop(adds_lane_); });
  } catch (...) {  // no second thread (a pid limit): stop the first before the members go
    close();
    throw;
  }
}

OffloadEngine::~OffloadEngine() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; close() only joins threads
  }
}

void OffloadEngine::close() {
  if (closed_) return;
  if (forked()) {
    // A forked child: the lanes, the pools and the copy backend's threads were the parent's and are not
    // here; joining or stopping them would hang or crash. The engine is never destroyed here (py_engine.cpp).
    closed_ = true;
    return;
  }
  {
    std::lock_guard<std::mutex> lock(qmu_);
    stop_ = true;
  }
  qcv_.notify_all();
  chunk_cv_.notify_all();
  // Each lane runs what is queued, then stops.
  for (Lane* lane : {&adds_lane_, &updates_lane_}) {
    if (lane->thread.joinable()) lane->thread.join();
  }
  transfer_.reset();                      // the host backend finishes its copies first
  pool_.reset();
  add_pool_.reset();
  // Views handed to Python keep their blocks alive; the engine lets go of them.
  for (Bucket& b : buckets_) {
    b.master = b.exp_avg = b.exp_avg_sq = b.staging[0] = b.staging[1] = nullptr;
    b.exp_avg_scale = b.exp_avg_sq_scale = nullptr;
    b.ahead = nullptr;   // delay_correction's pinned prediction: freed now, not with the engine object
    b.last_upload = nullptr;
  }
  chunks_.clear();
  for (Param& p : params_) {
    p.tensor = at::Tensor();
    p.staged = p.uploaded[0] = p.uploaded[1] = p.ahead_uploaded = nullptr;
    p.updated = {};
  }
  closed_ = true;
}

void OffloadEngine::check_usable() {
  TORCH_CHECK(!closed_, "OffloadAdam: the offload engine is closed (close() was called)");
  TORCH_CHECK(!forked(), "OffloadAdam: this optimizer's engine belongs to the process that made it; "
              "this process was forked from it and has none of its threads. Call opt.close() here to use the model "
              "without it, then build a new optimizer if this process trains");
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    err = error_;
  }
  if (err) rethrow_worker_error(err);
}

// ------------------------------------------------------------------ worker

void OffloadEngine::enqueue(Lane& lane, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(qmu_);
    lane.queue.push_back(std::move(task));
    ++lane.queued;
  }
  qcv_.notify_all();  // both lanes wait on qcv_
}

void OffloadEngine::worker_loop(Lane& lane) {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(qmu_);
      qcv_.wait(lock, [&] { return stop_ || !lane.queue.empty(); });
      if (lane.queue.empty()) return;
      task = std::move(lane.queue.front());
      lane.queue.pop_front();
      lane.busy = true;
    }
    std::exception_ptr err;
    try {
      task();
    } catch (...) {
      err = std::current_exception();
    }
    if (err) record_error(err);
    {
      std::lock_guard<std::mutex> lock(qmu_);
      lane.busy = false;
      ++lane.done;
    }
    idle_cv_.notify_all();
  }
}

void OffloadEngine::record_error(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(qmu_);
  if (!error_) error_ = std::move(e);
}

void OffloadEngine::wait_idle() {
  std::unique_lock<std::mutex> lock(qmu_);
  idle_cv_.wait(lock, [&] {
    return updates_lane_.queue.empty() && !updates_lane_.busy && adds_lane_.queue.empty() && !adds_lane_.busy;
  });
}

void OffloadEngine::set_group(int64_t group, const GroupHparams& h) {
  TORCH_CHECK_INDEX(group >= 0 && group < static_cast<int64_t>(groups_.size()), "OffloadEngine.set_group: group ",
                    group, " out of range");
  std::lock_guard<std::mutex> lock(mu_);
  groups_[static_cast<size_t>(group)] = h;
}

void OffloadEngine::fail_next_update(const std::string& message, int64_t after, int64_t delay_ms) {
  TORCH_CHECK_VALUE(after >= 0 && delay_ms >= 0, "fail_next_update: after and delay_ms must be >= 0");
  std::lock_guard<std::mutex> lock(qmu_);
  fail_message_ = message.empty() ? "injected failure" : message;
  fail_after_ = after;
  fail_delay_ms_ = delay_ms;
}

// ------------------------------------------------------------------ views and counters

std::vector<at::Tensor> OffloadEngine::state(int64_t i) const {
  TORCH_CHECK(!closed_, "OffloadAdam: the offload engine is closed");
  TORCH_CHECK_INDEX(i >= 0 && i < static_cast<int64_t>(params_.size()), "OffloadEngine.state: index ", i,
                    " out of range");
  const Param& p = params_[static_cast<size_t>(i)];
  const Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
  std::vector<at::Tensor> out;
  const bool eight = options_.state_bits == 8;
  for (const auto& block : {b.master, b.exp_avg, b.exp_avg_sq}) {
    const bool codes = eight && block != b.master;
    char* data = static_cast<char*>(block->data()) + p.offset * (codes ? 1 : 4);
    std::shared_ptr<HostBlock> keep = block;
    out.push_back(at::from_blob(data, p.tensor.sizes(), p.tensor.strides(), [keep](void*) {},
                                at::TensorOptions().dtype(codes ? at::kByte : at::kFloat)));
  }
  if (eight) {
    const int64_t blocks = adam8_blocks(p.numel);
    for (const auto& block : {b.exp_avg_scale, b.exp_avg_sq_scale}) {
      std::shared_ptr<HostBlock> keep = block;
      out.push_back(at::from_blob(static_cast<float*>(block->data()) + p.block_offset, {blocks},
                                  [keep](void*) {}, at::TensorOptions().dtype(at::kFloat)));
    }
  }
  return out;
}

at::Tensor OffloadEngine::steps() const {
  std::shared_ptr<HostBlock> keep = steps_;
  return at::from_blob(steps_->data(), {static_cast<int64_t>(params_.size())}, [keep](void*) {},
                       at::TensorOptions().dtype(at::kFloat));
}

std::map<std::string, int64_t> OffloadEngine::counters() const {
  int64_t pinned = 0, pageable = steps_->bytes();
  auto count = [&](const std::shared_ptr<HostBlock>& block) {
    if (block) (block->pinned() ? pinned : pageable) += block->bytes();
  };
  for (const Bucket& b : buckets_) {
    for (const auto& block : {b.master, b.exp_avg, b.exp_avg_sq, b.exp_avg_scale, b.exp_avg_sq_scale,
                              b.staging[0], b.staging[1], b.ahead}) {
      count(block);
    }
  }
  for (const auto& c : chunks_) count(c);
  return {{"bytes_down", bytes_down_.load()},
          {"bytes_up", bytes_up_.load()},
          {"param_updates", updates_.load()},
          {"accumulations", accumulations_.load()},
          {"landed_sq_sums", landed_sq_sums_.load()},
          {"engine_pinned_bytes", pinned},
          {"engine_pageable_bytes", pageable},
          {"process_pinned_bytes", host_memory_counters().pinned.load()},
          {"process_pageable_bytes", host_memory_counters().pageable.load()}};
}

}  // namespace effmem::engine
