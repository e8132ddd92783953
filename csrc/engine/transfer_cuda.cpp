// The CUDA transfer backend: gradients go down on one side stream and new
// weights come up on another, so the two directions overlap each other and
// the compute stream. Ordering is by events only; the host never waits here
// except in Ticket::wait (called by the engine's worker, off the Python
// thread).
//
//   download: d2h waits for [compute stream at the call] and [last upload]
//             (the staging may still be being read by an upload), copies,
//             and tells the caching allocator the source is in use on d2h,
//             so the gradient can be freed at once without its memory being
//             reused before the copy has read it.
//   upload:   h2d waits for [compute stream at the last download or
//             record_readers()] (kernels still reading the old weights), copies.
//   fence:    the compute stream waits for the last upload.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>

#include "engine/transfer.h"

#define EFFMEM_CUDA_OK(expr)                                                                    \
  do {                                                                                          \
    const cudaError_t err_ = (expr);                                                            \
    TORCH_CHECK(err_ == cudaSuccess, "OffloadAdam: ", #expr, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace effmem::engine {
namespace {

// One CUDA event, destroyed with its last owner.
class Event : public Ticket {
 public:
  Event() { EFFMEM_CUDA_OK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() override { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void wait() override { EFFMEM_CUDA_OK(cudaEventSynchronize(event_)); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};
using EventPtr = std::shared_ptr<Event>;

EventPtr record(cudaStream_t stream) {
  auto e = std::make_shared<Event>();
  EFFMEM_CUDA_OK(cudaEventRecord(e->get(), stream));
  return e;
}

void free_pinned(void* p) { cudaFreeHost(p); }

class CudaTransfer : public Transfer {
 public:
  explicit CudaTransfer(int device)
      : device_(device),
        down_(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device))),
        up_(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device))) {}

  const char* name() const override { return "cuda"; }

  std::shared_ptr<HostBlock> allocate(int64_t bytes, bool pinned) override {
    if (!pinned) return allocate_pageable(bytes);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* ptr = nullptr;
    const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(std::max<int64_t>(bytes, 1)),
                                          cudaHostAllocPortable);
    TORCH_CHECK(err == cudaSuccess, "OffloadAdam: could not allocate ", bytes, " bytes of pinned host memory (",
                cudaGetErrorString(err), "); pass pin_state=False to keep the optimizer state in pageable memory");
    std::memset(ptr, 0, static_cast<size_t>(bytes));
    return std::make_shared<HostBlock>(ptr, bytes, true, &free_pinned);
  }

  TicketPtr download(const at::Tensor& src, int64_t src_offset, void* dst, int64_t bytes) override {
    check_device(src);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    const cudaStream_t compute = current();
    EventPtr produced = record(compute);
    std::lock_guard<std::mutex> lock(mu_);
    readers_ = produced;
    EFFMEM_CUDA_OK(cudaStreamWaitEvent(down_.stream(), produced->get(), 0));
    if (last_upload_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(down_.stream(), last_upload_->get(), 0));
    EFFMEM_CUDA_OK(cudaMemcpyAsync(dst, static_cast<const char*>(src.data_ptr()) + src_offset,
                                   static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, down_.stream()));
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), down_);
    return record(down_.stream());
  }

  TicketPtr upload(const void* src, const at::Tensor& dst, int64_t bytes) override {
    check_device(dst);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    std::lock_guard<std::mutex> lock(mu_);
    if (readers_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(up_.stream(), readers_->get(), 0));
    EFFMEM_CUDA_OK(cudaMemcpyAsync(dst.data_ptr(), src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                                   up_.stream()));
    last_upload_ = record(up_.stream());
    return last_upload_;
  }

  void record_readers() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    EventPtr e = record(current());
    std::lock_guard<std::mutex> lock(mu_);
    readers_ = e;
  }

  void fence() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    std::lock_guard<std::mutex> lock(mu_);
    if (last_upload_) EFFMEM_CUDA_OK(cudaStreamWaitEvent(current(), last_upload_->get(), 0));
  }

 private:
  cudaStream_t current() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
  }

  void check_device(const at::Tensor& t) const {
    TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "OffloadAdam (CUDA backend on cuda:", device_,
                "): expected a tensor on that device, got one on ", t.device());
  }

  const int device_;
  c10::cuda::CUDAStream down_, up_;
  std::mutex mu_;
  EventPtr readers_, last_upload_;
};

}  // namespace

std::unique_ptr<Transfer> make_cuda_transfer(int device) { return std::make_unique<CudaTransfer>(device); }

}  // namespace effmem::engine
