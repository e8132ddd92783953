// The offload engine behind effmem.OffloadAdam.
//
// Host memory, allocated once when the engine is built (never per step):
//   per bucket (a run of parameters of one dtype, in backward order):
//     master, exp_avg, exp_avg_sq  float32, one flat buffer each (state_bits
//                                  8: exp_avg, exp_avg_sq uint8 codes, and a
//                                  float32 scale per 256 elements of each
//                                  parameter, common/adam8_math.h)
//     staging                      param dtype: gradients land here, and
//                                  the kernel writes the new low-precision
//                                  weights over them in place, so one
//                                  buffer serves both directions (two
//                                  in delay mode, see below)
//   landing chunks (a small fixed pool): a gradient for a parameter whose
//     staging already holds one (accumulation over micro-batches) lands
//     here, and the worker adds it into the staging.
//
// Flow of one step:
//   grad_ready(i, grad)   (autograd thread, during backward) issues the
//                         copy of grad into staging and returns; the caller
//                         may free the gradient at once.
//   two worker threads    each takes its tasks in order. The update lane
//                         runs bucket updates (Adam over a bucket's
//                         parameters, spread over a thread pool, then the
//                         uploads of the new weights); the add lane runs
//                         accumulations, so that they never queue behind an
//                         update (delay mode runs one during the next
//                         step's micro-batches). An update waits for the
//                         adds queued before it. In overlap mode a bucket's
//                         update is queued as soon as all its parameters
//                         have landed.
//   step(scale)           queues the updates not yet queued, waits for the
//                         worker, then orders the parameters' next readers
//                         after the uploads.
//
// Delay mode (delayed parameter update): step() queues the updates and
// returns at once; the worker writes the new weights into the staging and
// does not upload them. Each bucket has two stagings, used in turns: the
// next step's gradients land in the other one while the update runs. A
// parameter's new weights go up ("install") at its first grad_ready outside
// accumulating() after the step (that backward is done with it), once its
// update is done. So the CPU update overlaps the next step's forward and
// backward passes, and gradients are one step stale. synchronize()
// installs whatever is still pending.
//
// Errors in the worker are kept and rethrown by the next call from Python;
// the worker keeps releasing landing chunks after an error, so no caller can
// block forever on one.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "common/adam_math.h"
#include "common/thread_pool.h"
#include "engine/transfer.h"

namespace effmem::engine {

struct EngineOptions {
  std::string backend = "host";     // "host" or "cuda"
  int device = -1;                  // CUDA device index for the cuda backend
  int num_threads = 1;              // threads running the Adam update
  bool pin_state = true;            // page-lock master/m/v too (cuda backend)
  bool overlap = false;             // update buckets during backward
  bool delay = false;               // delayed parameter update (see above)
  int64_t landing_chunk_numel = 1 << 22;
  int64_t landing_chunks = 4;
  double host_delay_us = 0.0;       // host backend: random delay before each copy (tests)
  uint64_t seed = 0;
  int state_bits = 32;              // 32: float32 moments; 8: 8-bit moments
  // 8-bit rounding salt of parameter j: salt_base + j, its place in the optimizer (OffloadAdam's
  // device_state keeps the first parameters out of the engine, as FusedAdam's salts count them).
  int64_t salt_base = 0;
  // With delay: the forward, not the next backward, installs each parameter's new weights
  // (install_for_forward), and updates run in forward order (the last bucket first): exact math,
  // the update hidden behind the next forward as far as it runs ahead of it.
  bool install_in_forward = false;
  // With delay: the install also predicts the next step's weights from the gradient it comes with
  // (common/delay_correction_math.h): the update writes a prediction and Adam's partial denominator beside
  // the new weights (bucket.ahead), and the install uploads those and corrects them on the device.
  bool delay_correction = false;
};

struct GroupHparams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled = true, bias_correction = true;
};

class OffloadEngine {
 public:
  // params: the tensors written back (local shards under FSDP2), dense, of
  // float32/bf16/fp16. bucket_of[i], group_of[i]: the bucket and param group
  // of param i; buckets must hold one dtype and be numbered 0..B-1.
  // expects_grad[i]: false for parameters that never get a gradient.
  OffloadEngine(std::vector<at::Tensor> params, std::vector<int64_t> bucket_of, std::vector<int64_t> group_of,
                std::vector<bool> expects_grad, int64_t num_groups, EngineOptions options);
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  void set_group(int64_t group, const GroupHparams& h);
  void grad_ready(int64_t i, const at::Tensor& grad);
  // Per parameter, the sum of squares of its pending gradient (0 without
  // one); waits for the gradients to land. From its first call on, the sums
  // of the last micro-batch's gradients are taken as they land, during
  // backward (queue_sq_sum), with the same chunks and order of additions.
  std::vector<double> grad_sq_sums();
  // Updates every parameter holding a pending gradient, gradients first
  // multiplied by grad_scale; returns once the new weights are ordered
  // before the parameters' next readers (delay mode: at once). predict:
  // with delay_correction, whether the updates write the next backward's
  // prediction (false where the caller installs the next step's own weights
  // anyway: a warm-up step follows, whose synchronize would supersede it).
  void step(double grad_scale, bool predict = true);
  void zero_grad();
  // Waits for the worker and every copy; in delay mode first installs the
  // weights not yet uploaded, so the parameters hold the latest update.
  // Returns the indices of the parameters it wrote (for Python to bump their
  // version counters: a graph saved before then refuses a backward).
  std::vector<int64_t> synchronize();
  // Waits for the updates in flight and installs nothing (delay's weights stay pending): before opt.state is
  // read or changed after a step() that returned before its update ended (async_step, delay).
  void wait_updates();
  // delay_correction: whether a synchronize() since the last step() or zero_grad() put an update's own
  // weights back in place of a prediction made from gradients still pending (a flush between backward and
  // step): the next forward reads them unless that step's weights go up at once.
  bool prediction_replaced() const {
    std::lock_guard<std::mutex> lock(mu_);
    return prediction_replaced_;
  }
  // Waits as synchronize() does, but drops the weights not yet uploaded (delay
  // mode) instead of installing them: the caller is replacing the state
  // (load_state_dict), and the parameters may already hold the weights that
  // go with the new state (a model checkpoint loaded first).
  void discard_pending();
  // install_in_forward: before a module's forward reads params `ids`, waits for
  // their updates, uploads their new weights and orders the caller's stream
  // after the uploads.
  void install_for_forward(const std::vector<int64_t>& ids);
  // The caller's stream waits for every gradient copy issued so far (see
  // Transfer::order_after_downloads).
  void order_after_downloads();
  // The caller's stream waits for every weight upload issued so far (overlap
  // and delay mode upload during backward; the next forward must wait).
  void fence();
  void set_accumulating(bool on);
  void close();
  bool closed() const { return closed_.load(); }
  // Held shared by every call from Python and exclusively by close() (py_engine.cpp): a call on another
  // thread (a DDP comm hook's grad_ready) finishes before close() frees what it uses, and two close()
  // calls run one after the other.
  std::shared_mutex& lifetime() const { return lifetime_; }
  // In a process forked from the one that made the engine: none of its threads are here. close() only marks
  // it closed, and the engine is never destroyed there (its members would wait for those threads).
  bool forked() const { return getpid() != owner_; }

  // Views of the host state of param i: master, exp_avg, exp_avg_sq (the
  // param's shape and strides; float32, or uint8 codes for state_bits 8, then
  // followed by exp_avg_scale and exp_avg_sq_scale, float32 [blocks]). They
  // keep the memory alive.
  std::vector<at::Tensor> state(int64_t i) const;
  // float32 [num_params]: step count of each parameter, updated in place.
  at::Tensor steps() const;
  std::map<std::string, int64_t> counters() const;
  int64_t param_updates() const { return updates_.load(); }
  const std::string& backend() const { return options_.backend; }

  // Testing: makes a bucket update throw (error propagation): the next one, or the one after `after`
  // more have run, `delay_ms` into it (a failure that lands after earlier buckets were installed).
  void fail_next_update(const std::string& message, int64_t after = 0, int64_t delay_ms = 0);

 private:
  void check_installable();
  struct Param {
    at::Tensor tensor;
    int64_t numel, bucket, group, offset;  // offset: elements into the bucket's buffers
    int64_t block_offset = 0;              // state_bits 8: blocks into the bucket's scale buffers
    int dtype;
    bool expects_grad;
    bool has_grad = false;       // staging holds a gradient not yet used by an update
    bool queued = false;         // overlap: its update is queued in this round
    bool landed = false;         // overlap: counted towards its bucket in this round
    // The sum of squares of its pending gradient, taken as the gradient landed (queue_sq_sum), when
    // sq_ready; sq_gen counts gradients, so a sum taken before a later one landed is not used.
    double sq_sum = 0.0;
    bool sq_ready = false;
    uint64_t sq_gen = 0;
    TicketPtr staged;            // the copy that filled its staging
    // Delay mode: staging[pending_side] (fp32: the master) holds new weights
    // not yet uploaded, written by the update behind `updated`; uploaded[s]
    // is the last upload that read this parameter's staging[s] (or master).
    bool pending_upload = false;
    int pending_side = 0;
    std::shared_future<void> updated;
    TicketPtr uploaded[2];
    TicketPtr ahead_uploaded;    // delay_correction: the last upload that read its part of bucket.ahead
    // delay_correction: bucket.ahead holds the prediction for its next update (kept over steps without a
    // gradient), not yet installed by a
    // corrected install (plain ones, a flush's, leave it: the next backward still predicts from it), and the
    // correction's constants, those of the update that wrote it
    bool predictable = false;
    DelayCorrection correction{};
    // delay_correction: the device holds the prediction, not staging[pending_side]'s weights (until step();
    // a flush before it puts those back)
    bool predicted = false;
  };
  struct Bucket {
    int dtype;
    int64_t numel = 0, expected = 0, landed = 0, blocks = 0;
    std::vector<int64_t> params;
    std::shared_ptr<HostBlock> master, exp_avg, exp_avg_sq;
    std::shared_ptr<HostBlock> exp_avg_scale, exp_avg_sq_scale;  // state_bits 8
    std::shared_ptr<HostBlock> staging[2];  // [1] in delay mode only
    std::shared_ptr<HostBlock> ahead;       // delay_correction: pred, then r, in the bucket's dtype
    TicketPtr last_upload;  // the last copy that read this bucket's host memory (guarded by mu_)
  };
  static int64_t element_size(int dtype);  // bytes per element of a dtype index
  void check_usable();
  // A worker thread and its queue; qmu_ guards both lanes.
  struct Lane {
    std::deque<std::function<void()>> queue;
    bool busy = false;
    int64_t queued = 0, done = 0;  // tasks ever queued and finished (in order)
    std::thread thread;
  };
  void enqueue(Lane& lane, std::function<void()> task);
  void worker_loop(Lane& lane);
  void wait_idle();
  // Queues the update of the given params of one bucket (caller holds mu_).
  // predict: delay_correction's prediction is written (step()'s predict).
  void queue_update_locked(int64_t bucket, std::vector<int64_t> params, double grad_scale, bool predict = false);
  void run_update(int64_t bucket, const std::vector<int64_t>& params, double grad_scale,
                  const std::vector<TicketPtr>& waits, const std::vector<GroupHparams>& hparams, int side,
                  bool predict);
  void record_error(std::exception_ptr e);
  // Delay mode: uploads param i's pending weights once its update is done; with delay_correction and
  // `grad` (the whole step's gradient, just made), the weights predicted from it instead.
  void install(int64_t i, const at::Tensor* grad = nullptr);
  void upload_pending_locked(Param& p, const at::Tensor* grad = nullptr);  // caller holds mu_; the update is done
  // Whether install(i, grad) has anything to put up: pending weights, or with a gradient a prediction.
  static bool installable(const Param& p, const at::Tensor* grad) {
    return p.pending_upload || (grad != nullptr && p.predictable);
  }
  void accumulate(int64_t i, const at::Tensor& grad);
  // Once clipping is in use (grad_sq_sums was called), grad_ready queues the sum of squares of param i's
  // gradient (the gen-th it got, landed in `data` by the copy `staged`) on the add lane, after its copy
  // and adds, for a gradient outside accumulating() (the last micro-batch's).
  void queue_sq_sum(int64_t i, uint64_t gen, TicketPtr staged, const char* data);
  int acquire_chunk();
  void release_chunk(int c);
  char* staging_of(const Param& p, int side) const;
  void wait_staged();

  EngineOptions options_;
  std::unique_ptr<Transfer> transfer_;
  // Threads for the update (and the clip norm), and their own for the adds:
  // a pool runs one job at a time, and an add must not wait for an update.
  std::unique_ptr<ThreadPool> pool_, add_pool_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<GroupHparams> groups_;
  std::shared_ptr<HostBlock> steps_;
  std::vector<std::shared_ptr<HostBlock>> chunks_;  // landing chunks

  // mu_ guards the bookkeeping above (flags, tickets, hyper-parameters).
  mutable std::mutex mu_;
  bool accumulating_ = false;
  bool eager_sq_ = false;  // clipping is in use: sums of squares are taken as the gradients land
  int side_ = 0;  // the staging this round's gradients land in (delay mode alternates)
  bool prediction_replaced_ = false;  // see prediction_replaced()

  // The workers' lanes; qmu_ guards them, error_ and the chunk free list.
  std::mutex qmu_;
  std::condition_variable qcv_, idle_cv_, chunk_cv_;
  Lane updates_lane_, adds_lane_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<int> free_chunks_;
  std::string fail_message_;
  int64_t fail_after_ = 0, fail_delay_ms_ = 0;
  // Delay mode: parameters given the new weights of the updates queued by the last step(), so that a
  // later bucket's failure can say that the model holds part of that step.
  int64_t installed_since_step_ = 0;
  std::atomic<bool> closed_{false};
  mutable std::shared_mutex lifetime_;
  const pid_t owner_ = getpid();  // a forked child has the engine but not its threads

  std::atomic<int64_t> bytes_down_{0}, bytes_up_{0}, updates_{0}, accumulations_{0}, landed_sq_sums_{0};
};

}  // namespace effmem::engine
