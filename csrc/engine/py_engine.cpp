// pybind11 bindings of the offload engine (effmem._C.OffloadEngine). Every
// call that may wait (for copies, for the worker) releases the GIL, so the
// autograd thread, the worker and Python never wait on each other for it.
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Exception.h>

#include <mutex>
#include <shared_mutex>

#include "engine/offload_engine.h"

namespace py = pybind11;

namespace effmem::engine {
namespace {

// A call from Python that uses what close() frees, or may wait: without the GIL (close() may wait for a
// thread that needs it), holding the engine's lifetime lock shared; close() holds it exclusively
// (offload_engine.h). The trivial setters and getters (set_group, set_accumulating, steps, param_updates)
// touch nothing close() frees: they keep the GIL and take no lock.
template <typename R, typename... A>
auto guarded(R (OffloadEngine::*method)(A...)) {
  return [method](OffloadEngine& e, A... args) -> R {
    py::gil_scoped_release no_gil;
    std::shared_lock<std::shared_mutex> alive(e.lifetime());
    return (e.*method)(std::forward<A>(args)...);
  };
}

template <typename R, typename... A>
auto guarded(R (OffloadEngine::*method)(A...) const) {
  return [method](const OffloadEngine& e, A... args) -> R {
    py::gil_scoped_release no_gil;
    std::shared_lock<std::shared_mutex> alive(e.lifetime());
    return (e.*method)(std::forward<A>(args)...);
  };
}

}  // namespace

void bind_engine(py::module_& m) {
  // c10's errors as the Python exceptions their macros promise, without the
  // C++ backtrace. Local to this module: a global translator would also
  // catch c10 errors thrown from torch's own bindings (pybind11 internals are
  // shared) and turn e.g. torch.OutOfMemoryError into a plain RuntimeError.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  using E = OffloadEngine;
  // Deleted without the GIL: the destructor joins the engine's threads, and
  // a copy thread dropping a tensor may need the GIL to do so.
  struct DeleteWithoutGil {
    void operator()(E* e) const {
      py::gil_scoped_release no_gil;
      if (e->forked()) return;  // a forked child: never destroyed (see forked())
      delete e;
    }
  };
  py::class_<E, std::unique_ptr<E, DeleteWithoutGil>>(
      m, "OffloadEngine", "The C++ offload engine behind effmem.OffloadAdam (see offload_engine.h)")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<int64_t> bucket_of, std::vector<int64_t> group_of,
                       std::vector<bool> expects_grad, int64_t num_groups, std::string backend, int device,
                       int num_threads, bool pin_state, bool overlap, bool delay, int64_t landing_chunk_numel,
                       int64_t landing_chunks, double host_delay_us, uint64_t seed, int state_bits,
                       bool install_in_forward, int64_t salt_base, bool delay_correction) {
             EngineOptions o;
             o.backend = std::move(backend);
             o.device = device;
             o.num_threads = num_threads;
             o.pin_state = pin_state;
             o.overlap = overlap;
             o.delay = delay;
             o.landing_chunk_numel = landing_chunk_numel;
             o.landing_chunks = landing_chunks;
             o.host_delay_us = host_delay_us;
             o.seed = seed;
             o.state_bits = state_bits;
             o.install_in_forward = install_in_forward;
             o.salt_base = salt_base;
             o.delay_correction = delay_correction;
             return std::unique_ptr<E, DeleteWithoutGil>(new E(std::move(params), std::move(bucket_of),
                                                               std::move(group_of), std::move(expects_grad),
                                                               num_groups, std::move(o)));
           }),
           py::arg("params"), py::arg("bucket_of"), py::arg("group_of"), py::arg("expects_grad"),
           py::arg("num_groups"), py::kw_only(), py::arg("backend"), py::arg("device") = -1,
           py::arg("num_threads") = 1, py::arg("pin_state") = true, py::arg("overlap") = false, py::arg("delay") = false,
           py::arg("landing_chunk_numel") = int64_t(1) << 22, py::arg("landing_chunks") = 4,
           py::arg("host_delay_us") = 0.0, py::arg("seed") = 0, py::arg("state_bits") = 32,
           py::arg("install_in_forward") = false, py::arg("salt_base") = 0,
           py::arg("delay_correction") = false)
      .def(
          "set_group",
          [](E& e, int64_t group, double lr, double beta1, double beta2, double eps, double weight_decay,
             bool decoupled, bool bias_correction) {
            e.set_group(group, GroupHparams{lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction});
          },
          py::arg("group"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("decoupled"), py::arg("bias_correction"))
      .def("grad_ready", guarded(&E::grad_ready), py::arg("index"), py::arg("grad"),
           "Start copying param `index`'s gradient to the host; the caller may free it on return")
      .def("grad_sq_sums", guarded(&E::grad_sq_sums),
           "Per parameter, the sum of squares of its pending gradient (0.0 without one)")
      .def("step", guarded(&E::step), py::arg("grad_scale") = 1.0, py::arg("predict") = true)
      .def("prediction_replaced", &E::prediction_replaced)
      .def("zero_grad", guarded(&E::zero_grad))
      .def("synchronize", guarded(&E::synchronize))
      .def("wait_updates", guarded(&E::wait_updates),
           "Waits for the updates in flight, installing no weights (delay mode's stay pending)")
      .def("discard_pending", guarded(&E::discard_pending),
           "Waits for the worker and every copy, dropping the weights not yet uploaded (delay mode)")
      .def("order_after_downloads", guarded(&E::order_after_downloads),
           "Later work on the current stream waits until every gradient copy so far has read its source")
      .def("fence", guarded(&E::fence), "The current stream waits for every weight upload issued so far")
      .def("install_for_forward", guarded(&E::install_for_forward), py::arg("ids"),
           "install_in_forward: the new weights of params `ids` up before a forward reads them")
      .def("set_accumulating", &E::set_accumulating, py::arg("on"))
      .def("close",
           [](E& e) {
             py::gil_scoped_release no_gil;
             if (e.forked()) {  // no other thread here, and the lock may be as a parent's thread left it
               e.close();
               return;
             }
             std::unique_lock<std::shared_mutex> sole(e.lifetime());
             e.close();
           })
      .def_property_readonly("closed", &E::closed)
      .def_property_readonly("backend", &E::backend)
      .def("state", guarded(&E::state), py::arg("index"),
           "(master, exp_avg, exp_avg_sq) views of param `index`'s host state; with state_bits=8 the moments "
           "are uint8 codes followed by (exp_avg_scale, exp_avg_sq_scale)")
      .def("steps", &E::steps, "float32 step count per parameter (a view, updated in place)")
      .def("counters", guarded(&E::counters))
      .def_property_readonly("param_updates", &E::param_updates,
                             "Bucket-parameter updates done so far (one atomic read: no lock, the GIL kept)")
      .def("fail_next_update", &E::fail_next_update, py::arg("message") = "", py::arg("after") = 0,
           py::arg("delay_ms") = 0, "Testing: make a bucket update raise (the next, or after `after` more), "
           "`delay_ms` into it");
}

}  // namespace effmem::engine
