// The Python classes of the saved-tensor store and hooks (saved.h).
#include "saved/saved.h"

#include <pybind11/stl.h>

namespace effmem {

void bind_saved_hooks(py::module_& m) {
  using namespace effmem::saved;
  py::class_<SavedEntry, EntryPtr>(m, "SavedEntry", "One compressed stretch of memory, shared by its saves")
      .def_readwrite("codes", &SavedEntry::codes)
      .def_readwrite("stats", &SavedEntry::stats)
      .def_readwrite("offload", &SavedEntry::offload)
      .def_readonly("rows", &SavedEntry::rows)
      .def_readonly("cols", &SavedEntry::cols)
      .def_readonly("n", &SavedEntry::n)
      .def_readonly("bits", &SavedEntry::bits)
      .def_readonly("group_size", &SavedEntry::group_size)
      .def_readonly("dtype", &SavedEntry::dtype)
      .def_readonly("saves", &SavedEntry::saves)
      .def_readonly("bytes_before", &SavedEntry::bytes_before)
      .def_readonly("bytes_after", &SavedEntry::bytes_after)
      .def_readonly("exact", &SavedEntry::exact);
  py::class_<SavedEntryRef>(m, "SavedEntryRef", "A weak reference to a SavedEntry: call it for the entry or None")
      .def(py::init([](const EntryPtr& e) { return SavedEntryRef{e}; }), py::arg("entry"))
      .def("__call__", [](const SavedEntryRef& r) -> py::object {
        EntryPtr e = r.ref.lock();
        return e ? py::cast(e) : py::none();
      });
  py::class_<SavedHandle>(m, "SavedHandle", "One compressed save: its entry and its view of the entry's memory")
      .def_readonly("entry", &SavedHandle::entry)
      .def_readonly("shape", &SavedHandle::shape)
      .def_readonly("stride", &SavedHandle::stride)
      .def_readonly("offset", &SavedHandle::offset);
  py::class_<KeptTensor>(m, "KeptTensor", "A save kept as it is: a detached alias and its version")
      .def(py::init([](const at::Tensor& t, int64_t version) { return KeptTensor{t, version}; }),
           py::arg("tensor"), py::arg("version"))
      .def_readonly("tensor", &KeptTensor::tensor)
      .def_readonly("version", &KeptTensor::version);
  py::class_<Recipe, RecipePtr>(m, "Recipe", "How backward rebuilds an output the fast policy does not store")
      .def("alive", &Recipe::alive, "Whether the output still lives")
      .def_readwrite("saves", &Recipe::saves)
      .def_readonly("shape", &Recipe::shape)
      .def_readonly("stride", &Recipe::stride);
  py::class_<RecipeHandle>(m, "RecipeHandle", "One save of a rebuilt output: its view, and the cast of a copy")
      .def(py::init([](RecipePtr r, std::vector<int64_t> shape, std::vector<int64_t> stride, int64_t offset,
                       std::optional<at::ScalarType> cast) {
             return RecipeHandle{std::move(r), std::move(shape), std::move(stride), offset, cast};
           }),
           py::arg("recipe"), py::arg("shape"), py::arg("stride"), py::arg("offset"), py::arg("cast") = py::none())
      .def_readonly("recipe", &RecipeHandle::recipe);
  py::class_<SavedTensors>(m, "SavedTensors", "The saved-tensor store and hooks of compress_activations")
      .def(py::init<int64_t, int64_t, int64_t, bool, py::object>(), py::arg("bits"), py::arg("group_size"),
           py::arg("seed"), py::arg("stochastic"), py::arg("owner"))
      .def("store", &SavedTensors::store, py::arg("tensor"))
      .def("live_entries", &SavedTensors::live_entries)
      .def("add_recipe", &SavedTensors::add_recipe, py::arg("out"), py::arg("fn"), py::arg("inputs"))
      .def("recipe_save", &SavedTensors::recipe_save, py::arg("tensor"))
      .def("pack", &SavedTensors::pack, py::arg("tensor"))
      .def("pin_compared", &SavedTensors::pin_compared, py::arg("out"))
      .def("note_recipe", &SavedTensors::note_recipe, py::arg("tensor"), py::arg("recipe"),
           "A save of `tensor` made from `recipe` in Python (a cast of a rebuilt output): pin_compared's candidate")
      .def("unpack", &SavedTensors::unpack, py::arg("packed"))
      .def("set_layer", &SavedTensors::set_layer, py::arg("external"), py::arg("token_values"),
           py::arg("param_shapes"))
      .def("take_tallies", &SavedTensors::take_tallies)
      .def("first_keep", &SavedTensors::first_keep, py::arg("tensor"))
      .def("clear_kept", &SavedTensors::clear_kept)
      .def_readwrite("min_numel", &SavedTensors::min_numel_)
      .def_readwrite("collect", &SavedTensors::collect_)
      .def_readonly("work_ns", &SavedTensors::work_ns_)
      .def_readonly("quantize_calls", &SavedTensors::quantize_calls_)
      .def_readonly("dequantize_calls", &SavedTensors::dequantize_calls_)
      .def_readonly("rebuild_calls", &SavedTensors::rebuild_calls_);
  m.def("layout_kept", &SavedTensors::layout_kept, py::arg("tensor"), py::arg("group_size"),
        "The reason the store keeps tensor as it is for its layout alone (overlapping, strided_view, unsupported), "
        "or None");
  m.def("compares_with_extreme", &compares_with_extreme, py::arg("out"),
        "Whether out's grad_fn finds its input's extreme by equality with out (amax, max(), ...)");
}

}  // namespace effmem
