// effmem._C.SavedTensors: the saved-tensor hooks of compress_activations and
// of the "fast" activation policy, in C++.
//
// Why C++: a pack hook runs for every tensor autograd saves, and in Python
// each of its few dozen attribute reads, dict lookups and view ops costs a
// microsecond or more in the middle of a forward (cold caches): about 30 us
// per save on a 2-core VM, where issue 10 asks for 10. Here the common cases
// (a weight kept, a statistic kept, an activation quantised once per memory,
// an output the policy rebuilds, each restored) never enter Python but for
// the rebuild's own function; the rare ones (tensor subclasses, meta tensors,
// bool and integer tensors, autocast copies of weights and of rebuilt outputs)
// call back into the Python rules (compress/hooks.py, activations/fast.py),
// which use this same store.
//
// store.cpp: the dedup store (quantise once per memory, restore once) and the
// rebuild recipes; layout.cpp: which layouts it compresses, and how; hooks.cpp:
// the "fast" pack rules and the unpack hook; bindings.cpp: the Python classes.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace effmem::saved {

namespace py = pybind11;

// One compressed stretch of memory, shared by every save of it.
struct SavedEntry {
  std::optional<at::Tensor> codes, stats;  // both None while activations.offload holds them on the host
  int64_t rows = 0, cols = 0, n = 0, bits = 8, group_size = 128;
  at::ScalarType dtype = at::kFloat;
  int64_t saves = 1, unpacked = 0;  // saves made / unpacked since the last full round
  int64_t bytes_before = 0, bytes_after = 0;
  // The memory's version counter (autograd checks saves for in-place changes only without
  // saved_tensors_hooks, so restore makes that check) and its value when saved; none for inference tensors.
  std::optional<c10::VariableVersion> counter;
  int64_t version = 0;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;  // a hit needs the memory unchanged
  // The dequantised memory while some restored save still lives, and its tensor's dispatch keys.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> restored;
  c10::DispatchKeySet restored_keys;
  // One version counter for every save restored over that memory, as views of one tensor share theirs, and
  // its value at the restore: a backward that changes one in place is caught at the next unpack, as autograd
  // catches it between saves of one tensor.
  std::optional<c10::VariableVersion> restored_counter;
  int64_t restored_version = 0;
  std::optional<at::Tensor> held;  // kept until every save of the memory has been unpacked
  py::object offload = py::none();  // activations.offload's record while the codes are on the host
  // The memory itself, codes dropped (pin_compared): a save whose backward compares it with its own maximum
  std::optional<at::Tensor> exact;
  int64_t round = 0;  // the statistics' round (SavedTensors::clear_kept) that counted it as compressed
};
using EntryPtr = std::shared_ptr<SavedEntry>;

// A weak reference to an entry (Python's weakref would refer to its Python wrapper, which goes with the last
// Python reference while handles keep the entry itself).
struct SavedEntryRef {
  std::weak_ptr<SavedEntry> ref;
};

// What autograd holds for one compressed save: the entry and this save's view of its memory.
struct SavedHandle {
  EntryPtr entry;
  std::vector<int64_t> shape, stride;
  int64_t offset = 0;
};

// A save kept as it is: a detached alias (same memory, same version counter) and its version.
struct KeptTensor {
  at::Tensor tensor;
  int64_t version = 0;
};

// How backward rebuilds an output the "fast" policy does not store (a norm's, SwiGLU's): fn applied to its
// packed inputs, once for all of the output's saves.
struct Recipe {
  py::object fn;
  std::vector<py::object> inputs;  // packed (KeptTensor, SavedHandle, RecipeHandle) or plain values
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> owner;  // the output
  int64_t owner_offset = 0;
  std::vector<int64_t> shape, stride;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  std::optional<c10::VariableVersion> counter;
  int64_t version = 0, saves = 0, unpacked = 0;
  std::optional<at::Tensor> held;  // the rebuilt output until its last save is unpacked
  std::optional<at::Tensor> exact;  // the output itself (a detached alias), not rebuilt: pin_compared
  bool alive() const { return owner && !owner->expired(); }  // a save of its memory must come while it lives
};
using RecipePtr = std::shared_ptr<Recipe>;

// One save of a rebuilt output: its view of the output, cast to `cast` for a save of autocast's copy.
struct RecipeHandle {
  RecipePtr recipe;
  std::vector<int64_t> shape, stride;
  int64_t offset = 0;
  std::optional<at::ScalarType> cast;
};

// A tensor over t's memory with the given geometry, made without the dispatcher: a view op through it
// (as_strided) costs 2 us in a loop and 10 to 25 us in the middle of a backward. Not a view in autograd's
// sense, which is what autograd makes of an unpacked save anyway (it detaches it).
at::Tensor view_of(const at::Tensor& t, at::IntArrayRef shape, at::IntArrayRef stride, int64_t offset);
// The length of a dense tensor's rows in memory, which its quantisation groups stay within (layout.cpp).
int64_t memory_row(const at::Tensor& t);
// t's version counter, which every view of its memory bumps; none for an inference tensor.
std::optional<c10::VariableVersion> version_counter(const at::Tensor& t);

// Whether out is a reduction's result whose backward gives the gradient to the input's elements equal to it
// (pin_compared's test; compress.policy.compared_inputs asks it too).
bool compares_with_extreme(const at::Tensor& out);

// Whether o is a T: the Python type looked up once (py::isinstance looks it up by C++ type each call).
template <typename T>
bool is_a(py::handle o) {
  static PyTypeObject* const type = reinterpret_cast<PyTypeObject*>(py::type::of<T>().ptr());
  return Py_TYPE(o.ptr()) == type;
}

// Holds `out` until the last of `saves` is unpacked (one restore or rebuild for q, k and v), then lets go,
// so that a graph kept with retain_graph=True makes it afresh the next time.
inline void hold_until_last(int64_t& unpacked, int64_t saves, std::optional<at::Tensor>& held, const at::Tensor& out) {
  if (++unpacked < saves) {
    if (!held) held = out;
  } else {
    held.reset();
    unpacked = 0;
  }
}

struct Key {
  const void* storage;
  int64_t version, offset, n;
  int dtype;
  bool operator==(const Key& o) const {
    return storage == o.storage && version == o.version && offset == o.offset && n == o.n && dtype == o.dtype;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const;
};

class SavedTensors {
 public:
  SavedTensors(int64_t bits, int64_t group_size, int64_t seed, bool stochastic, py::object owner);

  // store.cpp: t's memory as codes shared by every save of it: a SavedHandle, or the reason (a str) to keep t.
  py::object store(const at::Tensor& t);
  at::Tensor restore(SavedHandle& h);
  py::list live_entries();
  RecipePtr add_recipe(const at::Tensor& out, py::object fn, const std::vector<py::object>& inputs);
  // A save of a rebuilt output's memory (unchanged, the output alive): its handle, else None.
  py::object recipe_save(const at::Tensor& t);
  at::Tensor rebuild(RecipeHandle& h);

  // hooks.cpp
  py::object pack(py::handle obj);
  py::object unpack(py::handle packed);
  void set_layer(const std::vector<int64_t>& external, int64_t token_values,
                 const std::vector<std::pair<int64_t, int64_t>>& param_shapes);
  std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> take_tallies();
  // Whether t's memory is kept (and counted) for the first time since set_layer or clear_kept: keep() and the
  // Python rules' _keep count a memory several ops save once, whichever of them keeps it.
  bool first_keep(const at::Tensor& t);
  void clear_kept() {  // a new forward's statistics (compressor's reset_stats): a new round
    kept_.clear();
    ++round_;
  }
  // hooks.cpp: called with each save before its own rules. When `out` is the result of a reduction whose
  // backward finds the extreme by equality (compares_with_extreme) and one of this thread's two latest
  // stored or rebuilt saves was that reduction's input, the input is kept as it is: its entry holds the
  // memory instead of its codes (a float32 group's maximum comes back 1 ulp off, and amax's backward divided
  // 0 by 0), a rebuilt output the output itself. The changes to the statistics, as take_tallies' rows.
  std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> pin_compared(const at::Tensor& out);
  // layout_keeps' reason as store names it ("overlapping", "strided_view", "unsupported"), or None: what
  // effmem plan's trace asks of each save (meta tensors do: only sizes, strides and views are read).
  static py::object layout_kept(const at::Tensor& t, int64_t group_size);
  // A save of t made from the recipe (store.cpp's recipe_save, Python's cast of a rebuilt output): a candidate
  void note_recipe(const at::Tensor& t, const RecipePtr& r);

  int64_t min_numel_ = 4096;
  py::object collect_ = py::none();  // under FastCompressor.collecting(): the list new entries go to
  // Time inside the quantize and dequantize calls and the calls made: what benchmarks subtract from the hooks'
  // time, and what tests count to see a memory quantised and dequantised once, an output rebuilt once.
  int64_t work_ns_ = 0, quantize_calls_ = 0, dequantize_calls_ = 0, rebuild_calls_ = 0;

 private:
  enum Reason { kCompressed, kDeduplicated, kParameter, kLayerInput, kSmall, kRowStatistic, kStatistic,
                kOverlapping, kStridedView, kNoGain, kUnsupported, kExponential, kAttentionOutput,
                kCompared, kReasonCount };
  static const char* const kReasons[kReasonCount];

  // store's work: the handle, or nothing and in `why` the reason to keep t (an entry made here goes to collect_).
  std::optional<SavedHandle> store_memory(const at::Tensor& t, Reason& why);
  // Where t's elements lie decides whether they can be compressed (store.cpp's top): the reason to keep t for
  // that alone, or nothing and the memory to quantise (t, or the dense tensor a view with gaps views) in src and
  // a view's group size (view_group; 0: the rows' rule) in aligned.
  static std::optional<Reason> layout_keeps(const at::Tensor& t, int64_t group_size, at::Tensor& src,
                                            int64_t& aligned);

  py::object keep(const at::Tensor& t, Reason r);
  struct Adjust {
    Reason reason;
    at::ScalarType dtype;
    int64_t count, before, after;
  };
  // A save just stored (its entry, the memory from `offset` of src) or rebuilt (its recipe): pin's candidates
  void note_store(const at::Tensor& t, const at::Tensor& src, int64_t offset, const EntryPtr& e);
  std::vector<Adjust> pin(const at::Tensor& out);
  at::Tensor exact_save(const SavedEntry& e, const SavedHandle& h);
  void tally(Reason r, at::ScalarType dtype, int64_t before, int64_t after, int64_t count = 1);
  void remember(const Key& key, const EntryPtr& e);
  py::object owner();
  [[noreturn]] void version_error(int64_t now, int64_t saved, at::ScalarType dtype,
                                  const std::vector<int64_t>& shape, at::Device device);

  int64_t bits_, group_size_;
  uint64_t seed_, next_seed_ = 0;
  bool stochastic_;
  py::object owner_;  // a weakref to the Python compressor (which holds this object)
  std::unordered_map<Key, std::weak_ptr<SavedEntry>, KeyHash> table_;
  size_t purge_at_;
  // Rebuilt outputs by storage; the compressor holds each recipe while its output lives.
  std::unordered_map<const void*, std::weak_ptr<Recipe>> recipes_;
  std::unordered_set<const void*> external_;
  // the memories kept in this layer call (first_keep): one kept by several ops (a fused attention's output,
  // which the output projection saves too) is held once, and counted once. Held weakly: a memory freed since
  // (a step's, under one `with compress_activations()` block) may come back at the same address, a new one.
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> kept_;
  int64_t token_values_ = 0;
  std::set<std::pair<int64_t, int64_t>> param_shapes_;
  std::map<std::pair<int, int>, std::array<int64_t, 3>> tallies_;
  // A recent stored save (its entry, the memory it covers from `offset`) or rebuilt one (its recipe), and the
  // autograd edge that reaches the saved tensor (its grad_fn and output number). The node by address only
  // (torch 2.11 holds nodes in shared_ptr, 2.14 in intrusive_ptr): a node freed and made again at that address
  // would pin a memory only while it lives and is still saved, which costs memory, never a wrong value.
  struct Recent {
    std::weak_ptr<SavedEntry> entry;
    std::weak_ptr<Recipe> recipe;
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> src;
    int64_t offset = 0;
    const torch::autograd::Node* fn = nullptr;
    uint32_t output_nr = 0;
  };
  void remember_recent(Recent r);
  // Per thread (two threads may run forwards through one compressor), the two latest: dist and cdist compare
  // both inputs. The GIL orders every access (the hooks and the store are called from Python).
  std::unordered_map<std::thread::id, std::array<Recent, 2>> recent_;
  int64_t round_ = 0;
};

}  // namespace effmem::saved
