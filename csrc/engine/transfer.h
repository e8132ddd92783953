// How gradients reach the host and new weights go back: the interface the
// offload engine uses, with two implementations.
//
// * CUDA (transfer_cuda.cpp): copies on two side streams (one per
//   direction), each ordered after the work that produced its source by
//   events; page-locked staging so the copies are true DMA.
// * Host (transfer_host.cpp): the "device" tensors are CPU tensors and a
//   thread does the copies in order, optionally after random delays. It
//   lets the whole pipeline (buckets, ordering, worker pool, write-back,
//   errors) run and be tested on a machine without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "common/delay_correction_math.h"
#include "engine/host_memory.h"

namespace effmem::engine {

// A copy in flight; wait() returns once its bytes have landed.
class Ticket {
 public:
  virtual ~Ticket() = default;
  virtual void wait() = 0;
};
using TicketPtr = std::shared_ptr<Ticket>;

class Transfer {
 public:
  virtual ~Transfer() = default;
  virtual const char* name() const = 0;

  // Zero-filled host memory; page-locked when `pinned` and the backend can
  // pin (the host backend never does: nothing crosses a bus).
  virtual std::shared_ptr<HostBlock> allocate(int64_t bytes, bool pinned) = 0;

  // Copies `bytes` from src (starting `src_offset` bytes into its data) to
  // host memory, after all work already queued that writes src, and after
  // the copy `after` (when given: the last upload that read that host
  // memory). src's memory is kept, and not reused, until the copy has
  // landed, so the caller may drop its last reference at once.
  virtual TicketPtr download(const at::Tensor& src, int64_t src_offset, void* dst, int64_t bytes,
                             const TicketPtr& after) = 0;

  // Copies host memory into dst, after the work queued on the caller's
  // stream at the last download or record_readers() call, or, with
  // after_current_stream, after the work queued on it now (recorded under
  // the same lock as the copy, so another thread's download in between
  // cannot stand in for it). The engine passes the returned ticket as
  // `after` to the next download into that host memory.
  virtual TicketPtr upload(const void* src, const at::Tensor& dst, int64_t bytes,
                           bool after_current_stream = false) = 0;

  // delay_correction: uploads `bytes` of predicted weights (pred) into dst, as upload(after_current_stream)
  // does, and as many bytes of r beside them, then sets dst = delay_correct(dst, r, grad) elementwise
  // (common/delay_correction_math.h). `grad` (dst's layout) was made by the work queued on the caller's
  // current stream; it is kept, and later downloads' order_after_downloads() waits for this reader too.
  virtual TicketPtr upload_corrected(const void* pred, const void* r, const at::Tensor& dst, const at::Tensor& grad,
                                     int64_t bytes, const DelayCorrection& c) = 0;

  // Later uploads also wait for the work queued so far on the caller's
  // current stream (kernels that may still read the old weights).
  virtual void record_readers() = 0;

  // Orders the parameters' consumers after every upload issued so far: on
  // CUDA the current stream waits for them (no host sync); on the host the
  // caller waits. Only the caller's current stream is ordered: kernels that
  // read the parameters on other streams must wait on it themselves.
  virtual void fence() = 0;

  // The host waits until every upload issued so far has landed (before the
  // engine lets Python write host memory that an upload may still read).
  virtual void wait_uploads() = 0;

  // Later work on the caller's current stream waits until every download
  // issued so far has read its source (for sources their owner overwrites in
  // place, such as DDP's gradient buckets). The host backend waits instead.
  virtual void order_after_downloads() = 0;
};

std::unique_ptr<Transfer> make_host_transfer(double max_delay_us, uint64_t seed);
// Throws when effmem was built without CUDA.
std::unique_ptr<Transfer> make_cuda_transfer(int device);

}  // namespace effmem::engine
