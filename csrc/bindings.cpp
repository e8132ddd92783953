// The pybind11 module effmem._C. Loading it registers the torch ops (see
// ops.cpp); the functions here describe the build and pick the CPU vector
// unit, and the stateful offload engine is bound in engine/py_engine.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "cpu/dispatch.h"

namespace py = pybind11;

namespace effmem {
void bind_saved_hooks(py::module_& m);
namespace engine {
void bind_engine(py::module_& m);
}
}  // namespace effmem

PYBIND11_MODULE(_C, m) {
  m.doc() = "effmem C++/CUDA core";
  m.def("torch_version", [] { return std::string(EFFMEM_TORCH_VERSION); },
        "Version of torch this extension was built against");
#ifdef EFFMEM_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif
  m.attr("cuda_architectures") = std::string(EFFMEM_CUDA_ARCHS);
  m.def("cpu_isa", [] { return std::string(effmem::cpu::kernels().name); },
        "The CPU vector unit the kernels use now: scalar, avx2 or avx512");
  m.def("supported_cpu_isas", &effmem::cpu::supported_isas, "The CPU vector units this CPU can run");
  m.def(
      "set_cpu_isa",
      [](const std::string& isa) {
        try {
          effmem::cpu::set_isa(isa);
        } catch (const c10::ValueError& e) {
          throw py::value_error(e.what_without_backtrace());
        }
      },
      py::arg("isa"),
        "Use the named CPU vector unit (for tests and benchmarks); raises ValueError if unsupported");
  m.def("num_threads", [] { return at::get_num_threads(); }, "Threads the CPU kernels use");
  effmem::engine::bind_engine(m);
  effmem::bind_saved_hooks(m);
}
