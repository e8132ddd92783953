// The CUDA transfer backend: gradients go down on one stream and new weights
// come up on another (both created here, not taken from torch's pool, so no
// other work shares them), so the two directions overlap each other and the
// compute stream. Ordering is by events only; the host never waits here
// except in Ticket::wait (called by the engine's worker, off the Python
// thread) and in wait_uploads / the destructor.
//
//   download: d2h waits for [compute stream at the call] and [the upload
//             that last read the destination, if any], copies, and tells the
//             caching allocator the source is in use on d2h, so the gradient
//             can be freed at once without its memory being reused before
//             the copy has read it.
//   upload:   h2d waits for [compute stream at the last download or
//             record_readers()] (kernels still reading the old weights), copies.
//   upload_corrected: as upload after the compute stream now, then r into scratch memory and the
//             correction kernel, all on h2d; the gradient it reads is marked in use on h2d, and
//             order_after_downloads waits for it as for the downloads.
//   fence:    the compute stream waits for the last upload.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "engine/delay_correction.h"
#include "engine/transfer.h"

#define EFFMEM_CUDA_OK(expr)                                                                    \
  do {                                                                                          \
    const cudaError_t err_ = (expr);                                                            \
    TORCH_CHECK(err_ == cudaSuccess, "OffloadAdam: ", #expr, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace effmem::engine {
namespace {

using DeviceGuard = c10::cuda::CUDAGuard;

c10::DeviceIndex index_of(int device) { return static_cast<c10::DeviceIndex>(device); }

// One CUDA event of one device, destroyed with its last owner. The guard in
// the destructor matters: the last owner may be the engine's worker thread,
// whose current device is not set, and touching another device there would
// create a CUDA context on it.
class Event : public Ticket {
 public:
  Event(int device, unsigned flags) : device_(device) {
    DeviceGuard guard(index_of(device_));
    EFFMEM_CUDA_OK(cudaEventCreateWithFlags(&event_, flags));
  }
  ~Event() override {
    try {  // the guard throws after a sticky CUDA error; a destructor must not
      DeviceGuard guard(index_of(device_));
      cudaEventDestroy(event_);
    } catch (...) {
    }
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void wait() override {
    // The engine's workers call this: a thread with no device set would make the runtime open a
    // context on GPU 0 (hundreds of MB there) for a rank training on another GPU.
    DeviceGuard guard(index_of(device_));
    EFFMEM_CUDA_OK(cudaEventSynchronize(event_));
  }
  cudaEvent_t get() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_;
};
using EventPtr = std::shared_ptr<Event>;

// Events only waited on by streams, and events the worker blocks on: the
// latter yield the CPU while waiting (the default spins a core that the
// Adam update could use).
constexpr unsigned kStreamEvent = cudaEventDisableTiming;
constexpr unsigned kHostEvent = cudaEventDisableTiming | cudaEventBlockingSync;

EventPtr record(int device, cudaStream_t stream, unsigned flags) {
  auto e = std::make_shared<Event>(device, flags);
  EFFMEM_CUDA_OK(cudaEventRecord(e->get(), stream));
  return e;
}

void free_pinned(void* p) { cudaFreeHost(p); }

cudaStream_t new_stream(int device) {
  DeviceGuard guard(index_of(device));
  cudaStream_t s = nullptr;
  EFFMEM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

// The two side streams of a device, created once and never destroyed: a
// gradient handed to download() is marked as used on the down stream
// (recordStream), and the caching allocator records an event on that stream
// whenever the gradient is freed, which may be long after the engine that
// copied it is gone (a tensor the caller kept, DDP's buckets).
struct SideStreams {
  cudaStream_t down, up;
};

SideStreams side_streams(int device) {
  static std::mutex mu;
  static std::unordered_map<int, SideStreams> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, SideStreams{new_stream(device), new_stream(device)}).first;
  return it->second;
}

class CudaTransfer : public Transfer {
 public:
  explicit CudaTransfer(int device)
      : device_(device), down_raw_(side_streams(device).down), up_raw_(side_streams(device).up),
        down_(c10::cuda::getStreamFromExternal(down_raw_, index_of(device))),
        up_(c10::cuda::getStreamFromExternal(up_raw_, index_of(device))) {}

  // Nothing may still be copying into or out of memory that is about to be
  // freed (pinned staging, landing chunks, parameters). The streams stay.
  ~CudaTransfer() override {
    try {
      DeviceGuard guard(index_of(device_));
      cudaStreamSynchronize(down_raw_);
      cudaStreamSynchronize(up_raw_);
    } catch (...) {
    }
    readers_ = last_upload_ = last_download_ = last_grad_reader_ = nullptr;
  }

  const char* name() const override { return "cuda"; }

  std::shared_ptr<HostBlock> allocate(int64_t bytes, bool pinned) override {
    if (!pinned) return allocate_pageable(bytes);
    DeviceGuard guard(index_of(device_));
    void* ptr = nullptr;
    const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(std::max<int64_t>(bytes, 1)),
                                          cudaHostAllocPortable);
    TORCH_CHECK(err == cudaSuccess, "OffloadAdam: could not allocate ", bytes, " bytes of pinned host memory (",
                cudaGetErrorString(err), "); pass pin_state=False to keep the optimizer state in pageable memory");
    std::memset(ptr, 0, static_cast<size_t>(bytes));
    return std::make_shared<HostBlock>(ptr, bytes, true, &free_pinned);
  }

  TicketPtr download(const at::Tensor& src, int64_t src_offset, void* dst, int64_t bytes,
                     const TicketPtr& after) override {
    check_device(src);
    DeviceGuard guard(index_of(device_));
    // Whole, under the lock: two threads handing gradients over at once (DDP's
    // callbacks) must leave last_download_ at the copy issued last.
    std::lock_guard<std::mutex> lock(mu_);
    EventPtr produced = record(device_, current(), kStreamEvent);
    EFFMEM_CUDA_OK(cudaStreamWaitEvent(down_raw_, produced->get(), 0));
    if (after) {
      const auto* upload = dynamic_cast<const Event*>(after.get());
      TORCH_CHECK(upload != nullptr, "OffloadAdam: `after` must be a ticket of this CUDA backend");
      EFFMEM_CUDA_OK(cudaStreamWaitEvent(down_raw_, upload->get(), 0));
    }
    EFFMEM_CUDA_OK(cudaMemcpyAsync(dst, static_cast<const char*>(src.data_ptr()) + src_offset,
                                   static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, down_raw_));
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), down_);
    EventPtr done = record(device_, down_raw_, kHostEvent);
    readers_ = produced;
    last_download_ = done;
    return done;
  }

  TicketPtr upload(const void* src, const at::Tensor& dst, int64_t bytes, bool after_current_stream) override {
    check_device(dst);
    DeviceGuard guard(index_of(device_));
    std::lock_guard<std::mutex> lock(mu_);
    if (after_current_stream) readers_ = record(device_, current(), kStreamEvent);
    if (readers_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(up_raw_, readers_->get(), 0));
    EFFMEM_CUDA_OK(cudaMemcpyAsync(dst.data_ptr(), src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                                   up_raw_));
    last_upload_ = record(device_, up_raw_, kHostEvent);
    return last_upload_;
  }

  TicketPtr upload_corrected(const void* pred, const void* r, const at::Tensor& dst, const at::Tensor& grad,
                             int64_t bytes, const DelayCorrection& c) override {
    check_device(dst);
    check_device(grad);
    DeviceGuard guard(index_of(device_));
    std::lock_guard<std::mutex> lock(mu_);
    // Scratch from the caching allocator on h2d: freed below, reused only by later work on that stream.
    // First, so that running out of memory leaves the parameter as it was.
    c10::DataPtr scratch;
    {
      c10::cuda::CUDAStreamGuard on_up(up_);
      scratch = c10::cuda::CUDACachingAllocator::get()->allocate(static_cast<size_t>(bytes));
    }
    readers_ = record(device_, current(), kStreamEvent);  // the old weights' readers, and grad's maker
    EFFMEM_CUDA_OK(cudaStreamWaitEvent(up_raw_, readers_->get(), 0));
    EFFMEM_CUDA_OK(cudaMemcpyAsync(dst.data_ptr(), pred, static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                                   up_raw_));
    EFFMEM_CUDA_OK(cudaMemcpyAsync(scratch.get(), r, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, up_raw_));
    cuda::launch_delay_correction(dst.data_ptr(), scratch.get(), grad.data_ptr(), dst.numel(), dst.scalar_type(),
                                  c, up_raw_);
    c10::cuda::CUDACachingAllocator::recordStream(grad.storage().data_ptr(), up_);
    last_upload_ = record(device_, up_raw_, kHostEvent);
    last_grad_reader_ = last_upload_;
    return last_upload_;
  }

  void record_readers() override {
    DeviceGuard guard(index_of(device_));
    EventPtr e = record(device_, current(), kStreamEvent);
    std::lock_guard<std::mutex> lock(mu_);
    readers_ = e;
  }

  void fence() override {
    DeviceGuard guard(index_of(device_));
    std::lock_guard<std::mutex> lock(mu_);
    if (last_upload_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(current(), last_upload_->get(), 0));
  }

  void order_after_downloads() override {
    DeviceGuard guard(index_of(device_));
    std::lock_guard<std::mutex> lock(mu_);
    if (last_download_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(current(), last_download_->get(), 0));
    if (last_grad_reader_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(current(), last_grad_reader_->get(), 0));
  }

  void wait_uploads() override {
    EventPtr last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = last_upload_;
    }
    if (last) last->wait();  // one stream: the last upload lands after all earlier ones
  }

 private:
  cudaStream_t current() const { return c10::cuda::getCurrentCUDAStream(index_of(device_)).stream(); }

  void check_device(const at::Tensor& t) const {
    TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "OffloadAdam (CUDA backend on cuda:", device_,
                "): expected a tensor on that device, got one on ", t.device());
  }

  const int device_;
  cudaStream_t down_raw_, up_raw_;
  c10::cuda::CUDAStream down_, up_;  // the raw streams as torch's type, for recordStream and the allocator
  std::mutex mu_;
  EventPtr readers_, last_upload_, last_download_, last_grad_reader_;
};

}  // namespace

std::unique_ptr<Transfer> make_cuda_transfer(int device) { return std::make_unique<CudaTransfer>(device); }

}  // namespace effmem::engine
