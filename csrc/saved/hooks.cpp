// The saved-tensor hooks (saved.h): the "fast" policy's pack rules
// (activations/fast.py states them; FastCompressor._pack there decides the
// cases left to Python) and the unpack hook of every compressor.
#include "saved/saved.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <typeinfo>

namespace torch::autograd::generated {
struct AminmaxBackward0;  // torch 2.13 and 2.14 define it, 2.11 does not (node_is below)
}  // namespace torch::autograd::generated

namespace effmem::saved {
namespace {

constexpr int64_t kRowStatMaxLastDim = 2;  // compress/policy.py's ROW_STAT_MAX_LAST_DIM
constexpr int64_t kStatisticFraction = 8;  // activations/fast.py's STATISTIC_FRACTION

bool is_float(at::ScalarType d) { return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf; }

bool is_parameter_object(PyObject* o) { return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(ParameterClass); }

// t.detach() without the dispatcher (about 1 us a call, more in the middle of a forward): an alias of t's
// memory sharing its version counter, without autograd history.
at::Tensor detached(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
}

bool is_parameter(const at::Tensor& t) {
  py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  return is_parameter_object(obj.ptr());
}

}  // namespace

const char* const SavedTensors::kReasons[kReasonCount] = {
    "compressed", "deduplicated", "parameter", "layer_input", "small", "row_statistic", "statistic",
    "overlapping", "strided_view", "no_gain", "unsupported", "exponential", "attention_output", "compared"};

py::object SavedTensors::pack(py::handle obj) {
  PyObject* o = obj.ptr();
  if (!recent_.empty() && THPVariable_Check(o)) {
    for (const Adjust& a : pin(THPVariable_Unpack(o))) tally(a.reason, a.dtype, a.before, a.after, a.count);
  }
  auto fallback = [&] { return owner().attr("_pack")(obj); };
  if (!THPVariable_CheckExact(o)) return fallback();  // a subclass: fake tensors while compiling...
  const at::Tensor& t = THPVariable_Unpack(o);
  if (t.is_nested()) return fallback();  // no single shape or strides: Python keeps it ("unsupported")
  if (is_parameter_object(o)) return py::cast(KeptTensor{t, t._version()});  // nothing to store or count
  at::Tensor base;
  if (t.is_view()) base = at::Tensor(t._base());
  const bool base_leaf = base.defined() && base.requires_grad() && base.is_leaf();
  if (base_leaf && is_parameter(base)) return py::cast(KeptTensor{detached(t), t._version()});  // weight.t()
  if (t.layout() != at::kStrided || t.is_meta() || t.numel() == 0) return fallback();
  // forward-mode AD's zero tangents (no memory) and lazily negated views: their bits are not their values
  if (t._is_zerotensor() || t.is_neg()) return fallback();
  const at::ScalarType dtype = t.scalar_type();
  if (!recipes_.empty()) {
    py::object h = recipe_save(t);  // an output the policy rebuilds: nothing stored
    if (!h.is_none()) {
      tally(kDeduplicated, dtype, 0, 0);
      return h;
    }
  }
  if ((t.requires_grad() && t.is_leaf()) || base_leaf) return keep(t, kParameter);
  if (external_.count(t.storage().unsafeGetStorageImpl())) return keep(t, kLayerInput);
  if (!is_float(dtype)) return fallback();  // bool masks, integers, float64: Python's rules
  const int64_t n = t.numel();
  if (n < min_numel_) return keep(t, kSmall);
  if (t.dim() == 0 || t.size(-1) <= kRowStatMaxLastDim) return keep(t, kRowStatistic);
  if (n * kStatisticFraction < token_values_) return keep(t, kStatistic);
  if (t.dim() == 2 && param_shapes_.count({t.size(0), t.size(1)})) return fallback();  // a weight's copy?
  const auto& fn = (base.defined() ? base : t).grad_fn();
  if (fn && fn->name() == "ToCopyBackward0") return fallback();  // autocast's copy of a rebuilt output?
  // exp's output, which its backward multiplies the gradient by: its values span orders of magnitude within a
  // group (Mamba2's decays exp(segsum(A)) run from 1 down to 0), and 8-bit codes of one step per group rounded
  // the small ones to nothing (a Bamba's A_log gradient 14.8% off, 1.0% kept as it is)
  if (fn && fn->name() == "ExpBackward0") return keep(t, kExponential);
  // a fused attention's output (flash, memory-efficient, cuDNN, the CPU's flash): its backward takes
  // D = rowsum(dO * O) from it beside a P rebuilt from q, k and the exact log-sum-exp, and a rounded O no
  // longer matches them. Where the residual stream has outlier channels (trained LLMs) O is nearly one
  // vector shared by every token, and that mismatch lands on dq at the size of the mean key: a Llama's
  // q_proj gradient 22.8% off (bench/activation_outliers.py), 8% with O kept as it is (+9% saved bytes)
  if (fn && fn->name().rfind("ScaledDotProduct", 0) == 0) return keep(t, kAttentionOutput);
  Reason why = kUnsupported;
  std::optional<SavedHandle> h = store_memory(t, why);
  if (!h) return keep(t, why);
  if (h->entry->saves == 1) {
    tally(kCompressed, dtype, h->entry->bytes_before, h->entry->bytes_after);
  } else {
    tally(kDeduplicated, dtype, 0, 0);
  }
  return py::cast(std::move(*h));
}

py::object SavedTensors::unpack(py::handle packed) {
  if (is_a<KeptTensor>(packed)) {
    const auto& k = packed.cast<const KeptTensor&>();
    if (k.tensor._version() != k.version) {
      version_error(k.tensor._version(), k.version, k.tensor.scalar_type(), k.tensor.sizes().vec(), k.tensor.device());
    }
    return py::cast(k.tensor);
  }
  if (is_a<SavedHandle>(packed)) return py::cast(restore(packed.cast<SavedHandle&>()));
  if (is_a<RecipeHandle>(packed)) return py::cast(rebuild(packed.cast<RecipeHandle&>()));
  return owner().attr("_unpack_other")(packed);  // a save made while compiling: the tensor itself
}

// Whether an autograd node is of type T, where torch's generated Functions.h may lack T: aminmax has a backward
// in torch 2.13 and 2.14 (2.11's headers have no AminmaxBackward0, and its aminmax takes no gradient). The type is
// declared below; one torch never defined stays incomplete, and no node is of it.
template <class T>
bool node_is(const std::type_info& type) {
  if constexpr (requires { sizeof(T); }) {
    return type == typeid(T);
  } else {
    return false;
  }
}

// The backwards that divide the gradient by the count of input elements equal to the result: amax and amin
// (scale_grad_by_count), max(), min(), median(), nanmedian() and aminmax() (evenly_distribute_backward), a
// vector norm of infinite order; and those that pick the elements whose difference equals it: dist and cdist
// of infinite p (for cdist, a wrong pick rather than 0/0).
bool compares_with_extreme(const at::Tensor& out) {
  using namespace torch::autograd::generated;
  const torch::autograd::Node* fn = out.grad_fn().get();
  if (!fn || fn->num_outputs() == 0) return false;
  const std::type_info& type = typeid(*fn);  // exact types: a compare each, where a failed dynamic_cast walks
  if (type == typeid(LinalgVectorNormBackward0)) {
    return std::isinf(static_cast<const LinalgVectorNormBackward0*>(fn)->ord.toDouble());
  }
  if (type == typeid(DistBackward0)) return std::isinf(static_cast<const DistBackward0*>(fn)->p.toDouble());
  if (type == typeid(CdistBackward0)) return std::isinf(static_cast<const CdistBackward0*>(fn)->p);
  return type == typeid(AmaxBackward0) || type == typeid(AminBackward0) || type == typeid(MaxBackward1) ||
         type == typeid(MinBackward1) || type == typeid(MedianBackward0) || type == typeid(NanmedianBackward0) ||
         node_is<AminmaxBackward0>(type);
}

void SavedTensors::remember_recent(Recent r) {
  auto& slots = recent_[std::this_thread::get_id()];
  slots[1] = std::move(slots[0]);
  slots[0] = std::move(r);
}

void SavedTensors::note_store(const at::Tensor& t, const at::Tensor& src, int64_t offset, const EntryPtr& e) {
  if (t.scalar_type() == at::kBool) return;  // a mask (a ReLU's, stored after its output): compared by none
  Recent r;
  r.entry = e;
  r.src = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(src.getIntrusivePtr());
  r.offset = offset;
  r.fn = t.grad_fn().get();
  r.output_nr = t.output_nr();
  remember_recent(std::move(r));
}

void SavedTensors::note_recipe(const at::Tensor& t, const RecipePtr& rec) {
  Recent r;
  r.recipe = rec;
  r.fn = t.grad_fn().get();
  r.output_nr = t.output_nr();
  remember_recent(std::move(r));
}

std::vector<SavedTensors::Adjust> SavedTensors::pin(const at::Tensor& out) {
  std::vector<Adjust> adjust;
  // the reduction saves its inputs, computes, then saves its result: its inputs' saves came just before
  if (!compares_with_extreme(out)) return adjust;
  auto found = recent_.find(std::this_thread::get_id());
  if (found == recent_.end()) return adjust;
  for (const torch::autograd::Edge& input : out.grad_fn()->next_edges()) {
    for (Recent& r : found->second) {
      // an input without a gradient (dist's detached `other`) has no edge: the latest save without a grad_fn
      const bool match = input.function ? input.function.get() == r.fn && input.input_nr == r.output_nr
                                        : r.fn == nullptr && !r.entry.expired();
      if (!match) continue;
      if (EntryPtr e = r.entry.lock()) {
        auto src = r.src->lock();
        if (src && !e->exact) {
          e->exact = view_of(at::Tensor(std::move(src)), {e->n}, {1}, r.offset);
          e->codes.reset();
          e->stats.reset();
          // counted as compressed in this round's statistics: now as kept (a round before: kept from now on)
          if (e->round == round_) adjust.push_back({kCompressed, e->dtype, -1, -e->bytes_before, -e->bytes_after});
          const int64_t kept = first_keep(*e->exact) ? e->bytes_before : 0;
          adjust.push_back({kCompared, e->dtype, 1, kept, kept});
        }
      } else if (RecipePtr rec = r.recipe.lock()) {
        // a rebuilt output: rebuilt from 8-bit inputs, its maximum is not the saved one either
        if (rec->alive() && !rec->exact) {
          const at::Tensor o(rec->owner->lock());
          rec->exact = detached(o);  // not o itself: its grad_fn holds this recipe's saves (a cycle)
          rec->inputs.clear();       // never rebuilt now: its inputs' codes go with their other saves
          const int64_t kept = first_keep(o) ? o.numel() * static_cast<int64_t>(o.element_size()) : 0;
          adjust.push_back({kCompared, rec->dtype, 1, kept, kept});
        }
      }
      r = Recent{};
    }
  }
  return adjust;
}

std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> SavedTensors::pin_compared(
    const at::Tensor& out) {
  std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> rows;
  for (const Adjust& a : pin(out)) rows.emplace_back(kReasons[a.reason], a.dtype, a.count, a.before, a.after);
  return rows;
}

at::Tensor SavedTensors::exact_save(const SavedEntry& e, const SavedHandle& h) {
  at::Tensor out = view_of(*e.exact, h.shape, h.stride, e.exact->storage_offset() + h.offset);
  if (e.counter) out.unsafeGetTensorImpl()->set_version_counter(*e.counter);
  return out;
}

bool SavedTensors::first_keep(const at::Tensor& t) {
  if (!t.has_storage()) return true;
  const at::Storage& storage = t.storage();
  auto it = kept_.find(storage.unsafeGetStorageImpl());
  if (it != kept_.end() && !it->second.expired()) return false;
  if (kept_.size() >= 4096) {  // a long `with` block: the memories freed since go (their weak references too)
    for (auto e = kept_.begin(); e != kept_.end();) e = e->second.expired() ? kept_.erase(e) : std::next(e);
  }
  kept_.insert_or_assign(storage.unsafeGetStorageImpl(), storage.getWeakStorageImpl());
  return true;
}

py::object SavedTensors::keep(const at::Tensor& t, Reason r) {
  const int64_t bytes = first_keep(t) ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  tally(r, t.scalar_type(), bytes, bytes);
  // A detached alias, not t: t may be the op's output, and a packed output holding its own grad_fn would be a
  // reference cycle. The alias shares t's version counter.
  return py::cast(KeptTensor{detached(t), t._version()});
}

void SavedTensors::tally(Reason r, at::ScalarType dtype, int64_t before, int64_t after, int64_t count) {
  auto& v = tallies_[{static_cast<int>(r), static_cast<int>(dtype)}];
  v[0] += count;
  v[1] += before;
  v[2] += after;
}

void SavedTensors::set_layer(const std::vector<int64_t>& external, int64_t token_values,
                             const std::vector<std::pair<int64_t, int64_t>>& param_shapes) {
  external_.clear();
  kept_.clear();
  for (int64_t k : external) external_.insert(reinterpret_cast<const void*>(k));
  token_values_ = token_values;
  param_shapes_ = std::set<std::pair<int64_t, int64_t>>(param_shapes.begin(), param_shapes.end());
}

std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> SavedTensors::take_tallies() {
  std::vector<std::tuple<std::string, at::ScalarType, int64_t, int64_t, int64_t>> out;
  for (auto& [k, v] : tallies_) {
    out.emplace_back(kReasons[k.first], static_cast<at::ScalarType>(k.second), v[0], v[1], v[2]);
  }
  tallies_.clear();
  return out;
}

}  // namespace effmem::saved
