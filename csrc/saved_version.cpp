// effmem._C.version_handle: an empty tensor that shares another tensor's
// version counter. compress_activations keeps one per saved tensor so that it
// can tell, when backward unpacks the save, whether the tensor was modified
// in place after it was saved (autograd makes that check itself only for
// saves without saved_tensors_hooks). Holding the tensor itself would keep
// the memory that compression is there to free; the handle holds no storage.
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

namespace py = pybind11;

namespace effmem {

void bind_saved_version(py::module_& m) {
  m.def(
      "version_handle",
      [](const at::Tensor& t) {
        at::Tensor handle = at::empty({0}, at::TensorOptions().dtype(at::kByte));
        if (!t.is_inference()) {
          handle.unsafeGetTensorImpl()->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
        }
        return handle;
      },
      py::arg("tensor"),
      "An empty tensor whose _version follows `tensor`'s (the same version counter), holding no storage");
}

}  // namespace effmem
