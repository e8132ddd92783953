// The host transfer backend: one thread performs every copy in the order
// they were issued (so an upload and a later download of the same staging
// are ordered for free), optionally sleeping a random time before each to
// shake out ordering bugs in tests.
#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "common/storage.h"
#include "engine/delay_correction.h"
#include "engine/transfer.h"

namespace effmem::engine {
namespace {

// delay_correction's device half as this backend runs it: w = delay_correct(w, r, g) over n elements.
template <class T>
void correct_typed(void* w_out, const void* r_in, const void* g_in, int64_t n, const DelayCorrection& c) {
  T* w = static_cast<T*>(w_out);
  const DelayR<T>* r = static_cast<const DelayR<T>*>(r_in);
  const T* g = static_cast<const T*>(g_in);
  for (int64_t i = 0; i < n; ++i) {
    store_float(w + i, round_to<T>(delay_correct(load_as_float(w + i), load_as_float(r + i),
                                                 load_as_float(g + i), c)));
  }
}

void correct_on_host(void* w, const void* r, const void* g, int64_t n, at::ScalarType dtype,
                     const DelayCorrection& c) {
  switch (dtype) {
    case at::kFloat: return correct_typed<float>(w, r, g, n, c);
    case at::kBFloat16: return correct_typed<bf16_t>(w, r, g, n, c);
    case at::kHalf: return correct_typed<f16_t>(w, r, g, n, c);
    default: TORCH_CHECK_TYPE(false, "delay_correction: parameters must be float32, bfloat16 or float16, got ", dtype);
  }
}

class HostTicket : public Ticket {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

class HostTransfer : public Transfer {
 public:
  HostTransfer(double max_delay_us, uint64_t seed) : max_delay_us_(max_delay_us), rng_(seed) {
    thread_ = std::thread([this] { loop(); });
  }

  ~HostTransfer() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  const char* name() const override { return "host"; }

  std::shared_ptr<HostBlock> allocate(int64_t bytes, bool) override { return allocate_pageable(bytes); }

  // FIFO copies: `after` was issued earlier, so it has landed first.
  TicketPtr download(const at::Tensor& src, int64_t src_offset, void* dst, int64_t bytes,
                     const TicketPtr&) override {
    TORCH_CHECK(src.device().is_cpu(), "OffloadAdam (host backend): expected a CPU tensor, got one on ",
                src.device());
    auto ticket = push(static_cast<const char*>(src.data_ptr()) + src_offset, dst, bytes, src);
    std::lock_guard<std::mutex> lock(mu_);
    last_download_ = ticket;
    return ticket;
  }

  // after_current_stream: CPU kernels have finished when they return.
  TicketPtr upload(const void* src, const at::Tensor& dst, int64_t bytes, bool /*after_current_stream*/) override {
    TORCH_CHECK(dst.device().is_cpu(), "OffloadAdam (host backend): expected a CPU tensor, got one on ",
                dst.device());
    auto ticket = push(src, dst.data_ptr(), bytes, dst);
    std::lock_guard<std::mutex> lock(mu_);
    last_upload_ = ticket;
    return ticket;
  }

  // FIFO: the correction runs on the copy thread right after its copies, reading grad, which the caller
  // may drop (its storage is kept) but not overwrite before order_after_downloads(): the download of that
  // gradient comes after this job in the queue.
  TicketPtr upload_corrected(const void* pred, const void* r, const at::Tensor& dst, const at::Tensor& grad,
                             int64_t bytes, const DelayCorrection& c) override {
    TORCH_CHECK(dst.device().is_cpu() && grad.device().is_cpu(),
                "OffloadAdam (host backend): expected CPU tensors, got ", dst.device(), " and ", grad.device());
    auto ticket = push(pred, dst.data_ptr(), bytes, dst,
                       Correction{r, grad.data_ptr(), grad.storage(), dst.numel(), dst.scalar_type(), c});
    std::lock_guard<std::mutex> lock(mu_);
    last_upload_ = ticket;
    return ticket;
  }

  void record_readers() override {}  // CPU kernels have finished when they return

  void fence() override { wait_uploads(); }

  void order_after_downloads() override {
    TicketPtr last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = last_download_;
    }
    if (last) last->wait();
  }

  void wait_uploads() override {
    TicketPtr last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = last_upload_;
    }
    if (last) last->wait();  // FIFO: everything issued before it has landed too
  }

 private:
  // The job keeps the tensor's storage, not the tensor: a tensor whose
  // Python object has died would need the GIL to be freed on this thread.
  struct Correction {  // upload_corrected's second half
    const void* r = nullptr;
    const void* grad = nullptr;
    c10::Storage grad_alive;
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
    DelayCorrection coeffs{};
  };
  struct Job {
    const void* src;
    void* dst;
    int64_t bytes;
    c10::Storage keep_alive;
    std::shared_ptr<HostTicket> ticket;
    std::optional<Correction> correct = std::nullopt;
  };

  TicketPtr push(const void* src, void* dst, int64_t bytes, const at::Tensor& keep,
                 std::optional<Correction> correct = std::nullopt) {
    auto ticket = std::make_shared<HostTicket>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back({src, dst, bytes, keep.storage(), ticket, std::move(correct)});
    }
    cv_.notify_one();
    return ticket;
  }

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stop requested and nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      if (max_delay_us_ > 0) {
        std::uniform_real_distribution<double> delay(0.0, max_delay_us_);
        std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(delay(rng_)));
      }
      std::memcpy(job.dst, job.src, static_cast<size_t>(job.bytes));
      if (job.correct) {
        const Correction& k = *job.correct;
        correct_on_host(job.dst, k.r, k.grad, k.numel, k.dtype, k.coeffs);
        job.correct.reset();
      }
      job.keep_alive = c10::Storage();
      job.ticket->finish();
    }
  }

  const double max_delay_us_;
  std::mt19937_64 rng_;  // used by the copy thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  TicketPtr last_upload_, last_download_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Transfer> make_host_transfer(double max_delay_us, uint64_t seed) {
  return std::make_unique<HostTransfer>(max_delay_us, seed);
}

#ifndef EFFMEM_WITH_CUDA
std::unique_ptr<Transfer> make_cuda_transfer(int) {
  TORCH_CHECK(false, "OffloadAdam: this build of effmem has no CUDA support (built without a CUDA compiler); "
                     "rebuild with CUDA_HOME set to a CUDA toolkit, or use CPU parameters");
}
#endif

}  // namespace effmem::engine
