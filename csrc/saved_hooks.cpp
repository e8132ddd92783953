// effmem._C.SavedTensors: the saved-tensor hooks of compress_activations and
// of the "fast" activation policy, in C++.
//
// Why C++: a pack hook runs for every tensor autograd saves, and in Python
// each of its few dozen attribute reads and dict lookups costs a microsecond
// or more in the middle of a forward (cold caches): about 30 us per save,
// where issue 10 asks for 10. Here the common cases (a weight kept, a
// statistic kept, an activation quantised once per memory, a save restored)
// never enter Python; the rare ones (tensor subclasses, meta tensors, bool
// and integer tensors' rules, autocast copies of weights and of outputs the
// policy rebuilds) call back into the Python rules (compress/hooks.py,
// activations/fast.py), which use this same table.
//
// The dedup table maps a stretch of memory (storage, dtype, version, offset,
// numel) to the entry holding its codes, weakly: entries live as long as a
// handle (one per save) refers to them, and a hit needs the storage alive, so
// that its memory cannot hold another tensor since.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace effmem {
namespace {

// One compressed stretch of memory, shared by every save of it.
struct SavedEntry {
  std::optional<at::Tensor> codes, stats;  // both None while activations.offload holds them on the host
  int64_t rows = 0, cols = 0, n = 0, bits = 8, group_size = 128;
  at::ScalarType dtype = at::kFloat;
  int64_t saves = 1, unpacked = 0;  // saves made / unpacked since the last full round
  int64_t bytes_before = 0, bytes_after = 0;
  // An empty tensor sharing the memory's version counter (autograd checks saves for in-place changes only
  // without saved_tensors_hooks, so restore makes that check) and the counter's value when saved.
  std::optional<at::Tensor> counter;
  int64_t version = 0;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  // The dequantised memory while some restored save still lives, and its tensor's dispatch keys.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> restored;
  c10::DispatchKeySet restored_keys;
  std::optional<at::Tensor> held;  // the dequantised tensor, kept until every save of it has been unpacked
  py::object offload = py::none();     // activations.offload's record while the codes are on the host
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

struct Key {
  const void* storage;
  int64_t version, offset, n;
  int dtype;
  bool operator==(const Key& o) const {
    return storage == o.storage && version == o.version && offset == o.offset && n == o.n && dtype == o.dtype;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<const void*>()(k.storage);
    for (int64_t v : {k.version, k.offset, k.n, static_cast<int64_t>(k.dtype)}) {
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};

enum Layout { kDense, kStrided, kOverlapping };

// compress/layout.py's classify: dense (one contiguous stretch, any dim order), strided (gaps) or
// overlapping (a stride too small for the dims inside it: expand, as_strided windows).
Layout classify(const at::Tensor& t) {
  if (t.is_contiguous()) return kDense;
  auto sizes = t.sizes();
  auto strides = t.strides();
  std::vector<int64_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  int64_t expected = 1;
  bool dense = true;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    int64_t d = *it;
    if (sizes[d] == 1) continue;  // never moves the pointer: its stride says nothing
    if (strides[d] < expected) return kOverlapping;
    if (strides[d] != expected) dense = false;
    expected = strides[d] * sizes[d];
  }
  return dense ? kDense : kStrided;
}

// A view of a tensor wider than this many times its size is kept rather than compressed through it.
constexpr int64_t kMaxBaseGrowth = 4;
constexpr size_t kTablePurgeMin = 1024;
constexpr int64_t kRowStatMaxLastDim = 2;  // compress/policy.py's ROW_STAT_MAX_LAST_DIM
constexpr int64_t kStatisticFraction = 8;  // activations/fast.py's STATISTIC_FRACTION

// A tensor over `storage` with the given geometry, made without the dispatcher: a view op through it
// (as_strided) costs 2 us in a loop and 10 to 25 us in the middle of a backward. Not a view in autograd's
// sense, which is what autograd makes of an unpacked save anyway (it detaches it).
at::Tensor over(c10::Storage storage, c10::DispatchKeySet keys, at::ScalarType dtype, at::IntArrayRef shape,
                at::IntArrayRef stride, int64_t offset) {
  at::Tensor t =
      at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(shape, stride, offset);
  return t;
}

at::Tensor view_of(const at::Tensor& t, at::IntArrayRef shape, at::IntArrayRef stride, int64_t offset) {
  return over(t.storage(), t.key_set(), t.scalar_type(), shape, stride, offset);
}

bool is_float(at::ScalarType d) { return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf; }

const void* storage_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

bool is_parameter_object(const at::Tensor& t) {
  py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(ParameterClass);
}

class SavedTensors {
 public:
  SavedTensors(int64_t bits, int64_t group_size, int64_t seed, bool stochastic, py::object owner)
      : bits_(bits), group_size_(group_size), seed_(static_cast<uint64_t>(seed)), stochastic_(stochastic) {
    // The compressor, weakly (it holds this object): its Python rules, bool packing and errors.
    owner_ = py::module_::import("weakref").attr("ref")(owner);
  }

  // ---------------------------------------------------------------- the shared store

  // t's memory as codes shared by every save of it: a SavedHandle, or the reason (a str) to keep t as it is.
  py::object store(const at::Tensor& t) {
    Layout layout = classify(t);
    if (layout == kOverlapping) return py::str("overlapping");
    at::Tensor src = t;  // the tensor whose memory is compressed: t, or the dense tensor t views
    if (layout != kDense) {
      if (!t.is_view()) return py::str("strided_view");
      const at::Tensor base(t._base());
      if (classify(base) != kDense || base.numel() > kMaxBaseGrowth * t.numel() || base.scalar_type() != t.scalar_type()) {
        return py::str("strided_view");
      }
      src = base;
    }
    const bool is_bool = t.scalar_type() == at::kBool;
    const int64_t n = src.numel(), nbytes = n * static_cast<int64_t>(src.element_size()), g = group_size_;
    const int64_t rows = n % g == 0 ? n / g : 1, cols = n % g == 0 ? g : n;
    if (!is_bool && packed_bytes(rows, cols) >= nbytes) return py::str("no_gain");

    const int64_t offset = src.storage_offset();
    SavedHandle h;
    h.shape = t.sizes().vec();
    h.stride = t.strides().vec();
    h.offset = t.storage_offset() - offset;
    const int64_t version = src.is_inference() ? 0 : src._version();
    Key key{storage_of(src), version, offset, n, static_cast<int>(src.scalar_type())};
    auto found = table_.find(key);
    if (found != table_.end()) {
      EntryPtr e = found->second.lock();
      if (e && e->storage && !e->storage->expired()) {
        ++e->saves;
        h.entry = std::move(e);
        return py::cast(std::move(h));
      }
    }

    auto e = std::make_shared<SavedEntry>();
    e->n = n;
    e->dtype = t.scalar_type();
    e->bits = bits_;
    e->group_size = g;
    e->storage = src.storage().getWeakStorageImpl();
    if (!src.is_inference()) {
      at::Tensor counter = at::empty({0}, at::TensorOptions().dtype(at::kByte));
      counter.unsafeGetTensorImpl()->set_version_counter(src.unsafeGetTensorImpl()->version_counter());
      e->counter = std::move(counter);
    }
    e->version = version;
    e->bytes_before = nbytes;
    {
      c10::AutoGradMode no_grad(false);
      if (is_bool) {
        at::Tensor flat = view_of(src, {n}, {1}, offset);
        e->codes = py::cast<at::Tensor>(codec().attr("pack_bool")(flat));
        e->rows = 1;
        e->cols = n;
        e->bytes_after = e->codes->numel();
      } else {
        at::Tensor groups = view_of(src, {rows, cols}, {cols, 1}, offset);
        const uint64_t seed = seed_ + next_seed_++;  // the kernels read the seed's 64 bits unsigned
        auto start = std::chrono::steady_clock::now();
        auto [codes, stats] = quantize_op().call(groups, bits_, g, static_cast<int64_t>(seed), stochastic_);
        work_ns_ += elapsed_ns(start);
        ++quantize_calls_;
        e->rows = rows;
        e->cols = cols;
        e->bytes_after = codes.numel() + stats.numel() * 4;
        e->codes = std::move(codes);
        e->stats = std::move(stats);
      }
    }
    remember(key, e);
    h.entry = std::move(e);
    return py::cast(std::move(h));
  }

  // The tensor a save's handle stands for: dequantised once per memory, however many saves view it.
  at::Tensor restore(SavedHandle& h) {
    c10::AutoGradMode no_grad(false);  // a restore must not join a create_graph backward's graph
    SavedEntry& e = *h.entry;
    if (!e.offload.is_none()) e.offload.attr("bring_back")();  // the codes back from host memory
    if (e.counter && e.counter->_version() != e.version) {
      version_error(*e.counter, e.version, e.dtype, h.shape, e.codes ? e.codes->device() : at::Device(at::kCPU));
    }
    if (e.restored) {  // restored already, and some unpacked save of it still lives: the same memory
      auto alive = e.restored->lock();
      if (alive) {
        c10::Storage storage(std::move(alive));
        at::Tensor out = over(storage, e.restored_keys, e.dtype, h.shape, h.stride, h.offset);
        count_unpack(e, out);  // holding any tensor over the memory holds the memory
        return out;
      }
    }
    TORCH_CHECK(e.codes.has_value(), "effmem: a compressed save's codes are gone (offloaded and not brought back)");
    at::Tensor flat;
    if (e.dtype == at::kBool) {
      flat = py::cast<at::Tensor>(codec().attr("unpack_bool")(*e.codes, e.n));
    } else {
      auto start = std::chrono::steady_clock::now();
      // [rows, cols] at storage offset 0: its storage is the flat memory the saves view
      flat = dequantize_op().call(*e.codes, *e.stats, e.bits, e.group_size, e.cols, e.dtype);
      work_ns_ += elapsed_ns(start);
      ++dequantize_calls_;
    }
    // Saves of one memory (q, k and v of one qkv) unpacked together share one buffer, as the originals
    // shared one storage.
    e.restored = flat.storage().getWeakStorageImpl();
    e.restored_keys = flat.key_set();
    at::Tensor out = view_of(flat, h.shape, h.stride, h.offset);
    count_unpack(e, std::move(flat));
    return out;
  }

  // Holds the restored tensor until every save of its memory has been unpacked (one dequantize for q, k and
  // v's inputs), then lets go, so that a graph kept with retain_graph=True restores it afresh the next time.
  static void count_unpack(SavedEntry& e, at::Tensor flat) {
    if (++e.unpacked < e.saves) {
      if (!e.held) e.held = std::move(flat);
    } else {
      e.held.reset();
      e.unpacked = 0;
    }
  }

  py::list live_entries() {
    py::list out;
    for (auto& [key, weak] : table_) {
      if (EntryPtr e = weak.lock()) out.append(py::cast(e));
    }
    return out;
  }

  // ---------------------------------------------------------------- the hooks

  // The unpack hook: kept saves and compressed ones here, the rest (rebuilt outputs, saves made while
  // compiling) by the compressor's _unpack_other.
  py::object unpack(py::handle packed) {
    if (py::isinstance<KeptTensor>(packed)) {
      auto& k = packed.cast<KeptTensor&>();
      if (k.tensor._version() != k.version) {
        version_error(k.tensor, k.version, k.tensor.scalar_type(), k.tensor.sizes().vec(), k.tensor.device());
      }
      return py::cast(k.tensor);
    }
    if (py::isinstance<SavedHandle>(packed)) return py::cast(restore(packed.cast<SavedHandle&>()));
    return owner().attr("_unpack_other")(packed);
  }

  // The "fast" policy's pack hook (activations/fast.py states the rules); Python's FastCompressor._pack
  // decides the cases it leaves.
  py::object pack(py::handle obj) {
    PyObject* o = obj.ptr();
    if (!THPVariable_CheckExact(o)) return fallback(obj);  // a subclass: fake tensors while compiling...
    const at::Tensor& t = THPVariable_Unpack(o);
    if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(ParameterClass)) return py::cast(KeptTensor{t, t._version()});
    at::Tensor base;
    if (t.is_view()) base = at::Tensor(t._base());
    const bool base_leaf = base.defined() && base.requires_grad() && base.is_leaf();
    if (base_leaf && is_parameter_object(base)) return py::cast(KeptTensor{t.detach(), t._version()});  // weight.t()
    if (t.layout() != at::kStrided || t.is_meta() || t.numel() == 0) return fallback(obj);
    const void* key = storage_of(t);
    if (python_keys_.count(key)) return fallback(obj);  // an output the policy rebuilds
    if ((t.requires_grad() && t.is_leaf()) || base_leaf) return keep(t, kParameter);
    if (external_.count(key)) return keep(t, kLayerInput);
    const at::ScalarType dtype = t.scalar_type();
    if (!is_float(dtype)) return fallback(obj);  // bool masks, integers, float64: Python's rules
    const int64_t n = t.numel();
    if (n < min_numel_) return keep(t, kSmall);
    if (t.dim() == 0 || t.size(-1) <= kRowStatMaxLastDim) return keep(t, kRowStatistic);
    if (n * kStatisticFraction < token_values_) return keep(t, kStatistic);
    if (t.dim() == 2 && param_shapes_.count({t.size(0), t.size(1)})) return fallback(obj);  // a weight's copy?
    const at::Tensor& made_from = base.defined() ? base : t;
    const auto& fn = made_from.grad_fn();
    if (fn && fn->name() == "ToCopyBackward0") return fallback(obj);  // autocast's copy of a rebuilt output?
    py::object stored = store(t);
    if (py::isinstance<py::str>(stored)) return keep(t, reason_index(stored.cast<std::string>()));
    auto& h = stored.cast<SavedHandle&>();
    if (h.entry->saves == 1) {
      tally(kCompressed, dtype, h.entry->bytes_before, h.entry->bytes_after);
      if (!collect_.is_none()) collect_.attr("append")(h.entry);
    } else {
      tally(kDeduplicated, dtype, 0, 0);
    }
    return stored;
  }

  // One layer call's rules: its other inputs' storages, tokens x hidden, 2-D parameter shapes.
  void set_layer(const std::vector<int64_t>& external, int64_t token_values,
                 const std::vector<std::pair<int64_t, int64_t>>& param_shapes) {
    external_.clear();
    for (int64_t k : external) external_.insert(reinterpret_cast<const void*>(k));
    token_values_ = token_values;
    param_shapes_ = std::set<std::pair<int64_t, int64_t>>(param_shapes.begin(), param_shapes.end());
  }

  // What pack kept and stored since the last call: (reason, dtype, count, bytes before, bytes after), reason
  // "compressed" or "deduplicated" for stored saves.
  std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> take_tallies() {
    std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> out;
    for (auto& [k, v] : tallies_) {
      out.emplace_back(kReasons[k.first], static_cast<at::ScalarType>(k.second), v[0], v[1], v[2]);
    }
    tallies_.clear();
    return out;
  }

  int64_t min_numel_ = 4096;
  py::object collect_ = py::none();  // under FastCompressor.collecting(): the list new entries go to
  std::unordered_set<const void*> python_keys_;
  // Time inside the quantize and dequantize calls and their number: what benchmarks subtract from the hooks'
  // time, and what tests count to see a memory quantised and dequantised once.
  int64_t work_ns_ = 0, quantize_calls_ = 0, dequantize_calls_ = 0;

  void add_python_key(int64_t k) { python_keys_.insert(reinterpret_cast<const void*>(k)); }
  void drop_python_key(int64_t k) { python_keys_.erase(reinterpret_cast<const void*>(k)); }

 private:
  enum Reason { kCompressed, kDeduplicated, kParameter, kLayerInput, kSmall, kRowStatistic, kStatistic,
                kOverlappingView, kStridedView, kNoGain, kReasonCount };
  static constexpr const char* kReasons[kReasonCount] = {
      "compressed", "deduplicated", "parameter", "layer_input", "small", "row_statistic", "statistic",
      "overlapping", "strided_view", "no_gain"};

  static Reason reason_index(const std::string& r) {
    for (int i = kOverlappingView; i < kReasonCount; ++i) {
      if (r == kReasons[i]) return static_cast<Reason>(i);
    }
    TORCH_CHECK(false, "effmem: unknown reason ", r);
    return kNoGain;
  }

  py::object keep(const at::Tensor& t, Reason r) {
    tally(r, t.scalar_type(), t.numel() * static_cast<int64_t>(t.element_size()), -1);
    // A detached alias, not t: t may be the op's output, and a packed output holding its own grad_fn
    // would be a reference cycle. The alias shares t's version counter.
    return py::cast(KeptTensor{t.detach(), t._version()});
  }

  void tally(Reason r, at::ScalarType dtype, int64_t before, int64_t after) {
    auto& v = tallies_[{static_cast<int>(r), static_cast<int>(dtype)}];
    v[0] += 1;
    v[1] += before;
    v[2] += after < 0 ? before : after;
  }

  int64_t packed_bytes(int64_t rows, int64_t cols) const {  // compress/_codec.py's packed_bytes
    const int64_t groups = (cols + group_size_ - 1) / group_size_;
    return rows * ((cols * bits_ + 7) / 8) + rows * groups * 2 * 4;
  }

  void remember(const Key& key, const EntryPtr& e) {
    if (table_.size() >= purge_at_) {  // the dead go first, once the table has doubled since the last purge
      for (auto it = table_.begin(); it != table_.end();) it = it->second.expired() ? table_.erase(it) : std::next(it);
      purge_at_ = std::max(kTablePurgeMin, 2 * table_.size());
    }
    table_[key] = e;
  }

  py::object owner() {
    py::object o = owner_();
    TORCH_CHECK(!o.is_none(), "effmem: the activation compressor these saves belong to is gone");
    return o;
  }
  py::object fallback(py::handle obj) { return owner().attr("_pack")(obj); }
  static py::object codec() { return py::module_::import("effmem.compress._codec"); }

  [[noreturn]] void version_error(const at::Tensor& counter, int64_t saved, at::ScalarType dtype,
                                  const std::vector<int64_t>& shape, at::Device device) {
    // compress/hooks.py's _check_version raises torch's RuntimeError, worded as torch words it
    py::module_::import("effmem.compress.hooks").attr("_check_version")(counter, saved, dtype, shape, device);
    TORCH_CHECK(false, "effmem: a saved tensor was modified in place");
  }

  static int64_t elapsed_ns(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }

  using QuantizeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t, int64_t, bool);
  using DequantizeFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, at::ScalarType);
  static const c10::TypedOperatorHandle<QuantizeFn>& quantize_op() {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("effmem::quantize", "").typed<QuantizeFn>();
    return op;
  }
  static const c10::TypedOperatorHandle<DequantizeFn>& dequantize_op() {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("effmem::dequantize", "").typed<DequantizeFn>();
    return op;
  }

  int64_t bits_, group_size_;
  uint64_t seed_, next_seed_ = 0;
  bool stochastic_;
  py::object owner_;
  std::unordered_map<Key, std::weak_ptr<SavedEntry>, KeyHash> table_;
  size_t purge_at_ = kTablePurgeMin;
  std::unordered_set<const void*> external_;
  int64_t token_values_ = 0;
  std::set<std::pair<int64_t, int64_t>> param_shapes_;
  std::map<std::pair<int, int>, std::array<int64_t, 3>> tallies_;
};

}  // namespace

void bind_saved_hooks(py::module_& m) {
  m.def("saved_view", &view_of, py::arg("tensor"), py::arg("shape"), py::arg("stride"), py::arg("offset"),
        "tensor's memory with the given sizes, strides and storage offset, as a tensor that is not a view in "
        "autograd's sense (made without the dispatcher: for unpack hooks)");
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
      .def_readonly("bytes_after", &SavedEntry::bytes_after);
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
  py::class_<SavedTensors>(m, "SavedTensors", "The saved-tensor store and hooks of compress_activations")
      .def(py::init<int64_t, int64_t, int64_t, bool, py::object>(), py::arg("bits"), py::arg("group_size"),
           py::arg("seed"), py::arg("stochastic"), py::arg("owner"))
      .def("store", &SavedTensors::store, py::arg("tensor"))
      .def("restore", &SavedTensors::restore, py::arg("handle"))
      .def("live_entries", &SavedTensors::live_entries)
      .def("pack", &SavedTensors::pack, py::arg("tensor"))
      .def("unpack", &SavedTensors::unpack, py::arg("packed"))
      .def("set_layer", &SavedTensors::set_layer, py::arg("external"), py::arg("token_values"),
           py::arg("param_shapes"))
      .def("take_tallies", &SavedTensors::take_tallies)
      .def("add_python_key", &SavedTensors::add_python_key)
      .def("drop_python_key", &SavedTensors::drop_python_key)
      .def_readwrite("min_numel", &SavedTensors::min_numel_)
      .def_readwrite("collect", &SavedTensors::collect_)
      .def_readonly("work_ns", &SavedTensors::work_ns_)
      .def_readonly("quantize_calls", &SavedTensors::quantize_calls_)
      .def_readonly("dequantize_calls", &SavedTensors::dequantize_calls_);
}

}  // namespace effmem
