// The dedup store behind the saved-tensor hooks (saved.h): a memory saved by
// several ops (the input of q, k and v) is quantised once and restored once,
// and an output the "fast" policy rebuilds is rebuilt once for all its saves.
//
// The table maps a stretch of memory (storage, dtype, version, offset, numel)
// to the entry holding its codes, weakly: entries live as long as a handle
// (one per save) refers to them, and a hit needs the storage alive, so that
// its memory cannot hold another tensor since. Where a tensor's elements lie
// decides how it is stored: a dense tensor (one contiguous stretch of its
// storage in any dim order: transposed, channels-last, a slice along the
// first dim) is quantised in memory order and restored stride for stride; a
// view with gaps (q, k and v sliced out of one qkv) through the dense tensor
// it views, when that is at most 4x larger (compiled backward graphs check
// saved strides, so a denser copy would not do); an overlapping one (expand,
// as_strided windows) is kept as it is (layout.cpp says which).
#include "saved/saved.h"

#include "common/checks.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <chrono>

namespace effmem::saved {
namespace {

// Whether an entry's groups lie within what a save of its memory sees: a view's runs (aligned > 0: flat groups
// dividing its group size), or rows of d, each group within one row (rows of e.cols that divide d: a head's
// rows within a token's). A group over several of the save's rows, as an alias with longer rows makes them
// ([32, 192]'s groups of 128 over [64, 96]'s rows), gave a small row its large neighbour's scale (relative
// error 49), a zero row non-zero codes, and a view of every other row the scale of rows it does not see.
bool groups_fit(const SavedEntry& e, int64_t d, int64_t aligned) {
  const int64_t g = e.group_size;
  if (e.cols == g) return aligned > 0 ? aligned % g == 0 : d % g == 0;
  return aligned == 0 && d % e.cols == 0;
}

// The table is purged of dead entries when it reaches this many (or twice the live ones after a purge).
constexpr size_t kTablePurgeMin = 1024;

const void* storage_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

at::Tensor over(c10::Storage storage, c10::DispatchKeySet keys, at::ScalarType dtype, at::IntArrayRef shape,
                at::IntArrayRef stride, int64_t offset) {
  // Inside the storage, or refused: a view past it (a handle's shape made up from Python) read and wrote
  // outside the memory and crashed the process.
  TORCH_CHECK_VALUE(shape.size() == stride.size(), "saved tensor view: ", shape.size(), " sizes but ",
                    stride.size(), " strides");
  bool empty = false, overflow = false;
  int64_t last = offset, step = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK_VALUE(shape[d] >= 0 && stride[d] >= 0, "saved tensor view: negative size or stride");
    empty = empty || shape[d] == 0;
    overflow = overflow || __builtin_mul_overflow(std::max<int64_t>(shape[d] - 1, 0), stride[d], &step) ||
               __builtin_add_overflow(last, step, &last);
  }
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t end = 0;   // bytes up to the last element's end
  overflow = overflow || __builtin_add_overflow(last, int64_t{1}, &end) || __builtin_mul_overflow(end, item, &end);
  TORCH_CHECK_VALUE(offset >= 0 && (empty || (!overflow && end <= static_cast<int64_t>(storage.nbytes()))),
                    "saved tensor view: sizes ", shape, ", strides ", stride, " and offset ", offset,
                    " reach past its storage of ", storage.nbytes(), " bytes");
  at::Tensor t =
      at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(shape, stride, offset);
  return t;
}

int64_t elapsed_ns(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

using QuantizeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t, int64_t, bool);
using DequantizeFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, at::ScalarType);

// The effmem::quantize and effmem::dequantize ops (ops.cpp), through the dispatcher: CPU or CUDA kernel.
const c10::TypedOperatorHandle<QuantizeFn>& quantize_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("effmem::quantize", "").typed<QuantizeFn>();
  return op;
}
const c10::TypedOperatorHandle<DequantizeFn>& dequantize_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("effmem::dequantize", "").typed<DequantizeFn>();
  return op;
}

py::object codec() { return py::module_::import("effmem.compress._codec"); }

bool is_packed(const py::object& o) { return is_a<KeptTensor>(o) || is_a<SavedHandle>(o) || is_a<RecipeHandle>(o); }

}  // namespace

at::Tensor view_of(const at::Tensor& t, at::IntArrayRef shape, at::IntArrayRef stride, int64_t offset) {
  return over(t.storage(), t.key_set(), t.scalar_type(), shape, stride, offset);
}

std::optional<c10::VariableVersion> version_counter(const at::Tensor& t) {
  if (t.is_inference()) return std::nullopt;
  return t.unsafeGetTensorImpl()->version_counter();
}

size_t KeyHash::operator()(const Key& k) const {
  size_t h = std::hash<const void*>()(k.storage);
  for (int64_t v : {k.version, k.offset, k.n, static_cast<int64_t>(k.dtype)}) {
    h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  }
  return h;
}

SavedTensors::SavedTensors(int64_t bits, int64_t group_size, int64_t seed, bool stochastic, py::object owner)
    : bits_(bits), group_size_(group_size), seed_(static_cast<uint64_t>(seed)), stochastic_(stochastic),
      purge_at_(kTablePurgeMin) {
  owner_ = py::module_::import("weakref").attr("ref")(owner);
}

py::object SavedTensors::store(const at::Tensor& t) {
  Reason why = kUnsupported;
  std::optional<SavedHandle> h = store_memory(t, why);
  return h ? py::cast(std::move(*h)) : py::str(kReasons[why]);
}

std::optional<SavedHandle> SavedTensors::store_memory(const at::Tensor& t, Reason& why) {
  auto keep = [&why](Reason r) {
    why = r;
    return std::nullopt;
  };
  at::Tensor src;  // the tensor whose memory is compressed: t, or the dense tensor t views
  int64_t aligned = 0;  // a view's group size (view_group), 0: the rows' rule
  if (const std::optional<Reason> kept = layout_keeps(t, group_size_, src, aligned)) return keep(*kept);
  const bool is_bool = t.scalar_type() == at::kBool;
  const int64_t n = src.numel(), nbytes = n * static_cast<int64_t>(src.element_size());
  // Groups within the rows of the memory (memory_row: d): flat groups of g where d is a multiple of g, one
  // group per row where d is a smaller group size (32, 64, 128 dividing g), else rows of d ending in a part
  // group, as ops.quantize makes them. Flat groups of g over the memory spanned two rows (tokens): a
  // left-padded row of exact zeros came back as its neighbour's rounding, and the huge gradient a norm gives
  // such a row reached the weights (Gemma3 at width 64: o_proj's gradient 16x off). compress/_codec.py's
  // saved_groups is the same rule. A view with gaps: flat groups of view_group's size, within its runs.
  const int64_t d = memory_row(src);
  int64_t rows = n / d, cols = d, g = group_size_;
  if (aligned > 0) {
    rows = n / aligned, cols = aligned, g = aligned;
  } else if (d % g == 0) {
    rows = n / g, cols = g;
  } else if (d >= 32 && g % d == 0) {
    g = d;   // 32, 64 or 128 below g: whole groups, one per row
  }
  const QuantLayout packed = quant_layout(n, cols, bits_, g);
  if (!is_bool && packed.rows * (packed.row_bytes + packed.groups_per_row * 2 * 4) >= nbytes) return keep(kNoGain);

  const int64_t offset = src.storage_offset();
  SavedHandle h{nullptr, t.sizes().vec(), t.strides().vec(), t.storage_offset() - offset};
  const int64_t version = src.is_inference() ? 0 : src._version();
  // Keyed by the memory covered, so that every view of it, in any shape, shares one entry.
  const Key key{storage_of(src), version, offset, n, static_cast<int>(src.scalar_type())};
  auto found = table_.find(key);
  if (found != table_.end()) {
    EntryPtr e = found->second.lock();
    // an entry whose groups straddle what this save sees (made through another alias) is not shared: this save
    // takes an entry of its own, which the table remembers from now on
    if (e && e->storage && !e->storage->expired() && (e->dtype == at::kBool || groups_fit(*e, d, aligned))) {
      ++e->saves;
      note_store(t, src, offset, e);
      h.entry = std::move(e);
      return h;
    }
  }

  auto e = std::make_shared<SavedEntry>();
  e->n = n;
  e->dtype = t.scalar_type();
  e->bits = bits_;
  e->group_size = g;
  e->storage = src.storage().getWeakStorageImpl();
  e->counter = version_counter(src);
  e->version = version;
  e->bytes_before = nbytes;
  e->round = round_;
  {
    c10::AutoGradMode no_grad(false);
    // the memory covered, in memory order, as the flat run (bool) or the [rows, cols] groups it is
    if (is_bool) {
      e->codes = py::cast<at::Tensor>(codec().attr("pack_bool")(view_of(src, {n}, {1}, offset)));
      e->rows = 1;
      e->cols = n;
      e->bytes_after = e->codes->numel();
    } else {
      const uint64_t seed = seed_ + next_seed_++;  // the kernels read the seed's 64 bits unsigned
      const auto start = std::chrono::steady_clock::now();
      auto [codes, stats] = quantize_op().call(view_of(src, {rows, cols}, {cols, 1}, offset), bits_, g,
                                               static_cast<int64_t>(seed), stochastic_);
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
  if (!collect_.is_none()) collect_.attr("append")(e);  // new here: activations.offload takes it
  note_store(t, src, offset, e);
  h.entry = std::move(e);
  return h;
}

at::Tensor SavedTensors::restore(SavedHandle& h) {
  c10::AutoGradMode no_grad(false);  // a restore must not join a create_graph backward's graph
  SavedEntry& e = *h.entry;
  if (e.counter && static_cast<int64_t>(e.counter->current_version()) != e.version) {
    const at::Tensor* where = e.codes ? &*e.codes : e.exact ? &*e.exact : nullptr;   // a kept entry has no codes
    version_error(e.counter->current_version(), e.version, e.dtype, h.shape, where ? where->device() : at::kCPU);
  }
  if (e.exact) return exact_save(e, h);
  if (!e.offload.is_none()) e.offload.attr("bring_back")();  // the codes back from host memory
  if (e.restored) {  // restored already, and some unpacked save of it still lives: the same memory
    if (auto alive = e.restored->lock()) {
      at::Tensor out = over(c10::Storage(std::move(alive)), e.restored_keys, e.dtype, h.shape, h.stride, h.offset);
      if (e.restored_counter) {
        const auto now = static_cast<int64_t>(e.restored_counter->current_version());
        if (now != e.restored_version) {
          version_error(now, e.restored_version, e.dtype, h.shape, e.codes ? e.codes->device() : at::Device(at::kCPU));
        }
        out.unsafeGetTensorImpl()->set_version_counter(*e.restored_counter);
      }
      hold_until_last(e.unpacked, e.saves, e.held, out);  // any tensor over the memory holds the memory
      return out;
    }
  }
  TORCH_CHECK(e.codes.has_value(), "effmem: a compressed save's codes are gone (offloaded and not brought back)");
  at::Tensor flat;
  if (e.dtype == at::kBool) {
    flat = py::cast<at::Tensor>(codec().attr("unpack_bool")(*e.codes, e.n));
  } else {
    const auto start = std::chrono::steady_clock::now();
    // [rows, cols] at storage offset 0: its storage is the flat memory the saves view
    flat = dequantize_op().call(*e.codes, *e.stats, e.bits, e.group_size, e.cols, e.dtype);
    work_ns_ += elapsed_ns(start);
    ++dequantize_calls_;
  }
  // Saves of one memory (q, k and v of one qkv) unpacked together share one buffer, as the originals shared
  // one storage.
  e.restored = flat.storage().getWeakStorageImpl();
  e.restored_keys = flat.key_set();
  hold_until_last(e.unpacked, e.saves, e.held, flat);
  at::Tensor out = view_of(flat, h.shape, h.stride, h.offset);
  e.restored_counter = version_counter(flat);  // none for an inference tensor
  if (e.restored_counter) {
    e.restored_version = static_cast<int64_t>(e.restored_counter->current_version());
    out.unsafeGetTensorImpl()->set_version_counter(*e.restored_counter);
  }
  return out;
}

py::list SavedTensors::live_entries() {
  py::list out;
  for (auto& [key, weak] : table_) {
    if (EntryPtr e = weak.lock()) out.append(py::cast(e));
  }
  return out;
}

void SavedTensors::remember(const Key& key, const EntryPtr& e) {
  if (table_.size() >= purge_at_) {  // the dead go first, once the table has doubled since the last purge
    for (auto it = table_.begin(); it != table_.end();) it = it->second.expired() ? table_.erase(it) : std::next(it);
    purge_at_ = std::max(kTablePurgeMin, 2 * table_.size());
  }
  table_[key] = e;
}

// ---------------------------------------------------------------- rebuilt outputs

RecipePtr SavedTensors::add_recipe(const at::Tensor& out, py::object fn, const std::vector<py::object>& inputs) {
  auto r = std::make_shared<Recipe>();
  r->fn = std::move(fn);
  r->inputs = inputs;
  r->owner = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(out.getIntrusivePtr());
  r->owner_offset = out.storage_offset();
  r->shape = out.sizes().vec();
  r->stride = out.strides().vec();
  r->dtype = out.scalar_type();
  r->device = out.device();
  r->counter = version_counter(out);
  if (r->counter) r->version = r->counter->current_version();
  if (recipes_.size() >= kTablePurgeMin) {  // outputs die after their layer: their recipes with them
    for (auto it = recipes_.begin(); it != recipes_.end();) it = it->second.expired() ? recipes_.erase(it) : std::next(it);
  }
  recipes_[storage_of(out)] = r;
  return r;
}

py::object SavedTensors::recipe_save(const at::Tensor& t) {
  if (t.is_nested()) return py::none();  // never a rebuilt output (those are dense)
  auto found = recipes_.find(storage_of(t));
  if (found == recipes_.end()) return py::none();
  RecipePtr r = found->second.lock();
  if (!r || !r->alive()) {  // its output is gone: its memory may hold another tensor now
    recipes_.erase(found);
    return py::none();
  }
  if (t.is_inference() || t._version() != r->version) return py::none();  // changed since: stored as any save
  ++r->saves;
  note_recipe(t, r);
  RecipeHandle h{r, t.sizes().vec(), t.strides().vec(), t.storage_offset() - r->owner_offset, std::nullopt};
  return py::cast(std::move(h));
}

at::Tensor SavedTensors::rebuild(RecipeHandle& h) {
  c10::AutoGradMode no_grad(false);  // a rebuild must not join a create_graph backward's graph
  Recipe& r = *h.recipe;
  if (r.counter && static_cast<int64_t>(r.counter->current_version()) != r.version) {
    version_error(r.counter->current_version(), r.version, r.dtype, h.shape, r.device);
  }
  at::Tensor out;
  if (r.exact || r.held) {
    out = r.exact ? *r.exact : *r.held;
  } else {
    py::tuple args(r.inputs.size());
    for (size_t i = 0; i < r.inputs.size(); ++i) {
      args[i] = is_packed(r.inputs[i]) ? unpack(r.inputs[i]) : r.inputs[i];
    }
    out = py::cast<at::Tensor>(r.fn(*args));
    ++rebuild_calls_;
    if (out.strides() != at::IntArrayRef(r.stride)) {  // the saves view the output's memory: lay it out as it was
      at::Tensor laid = at::empty_strided(r.shape, r.stride, out.options());
      laid.copy_(out);
      out = std::move(laid);
    }
  }
  hold_until_last(r.unpacked, r.saves, r.held, out);
  if (h.cast) out = out.to(*h.cast);  // autocast's copy, made as forward made it (to() keeps the layout)
  return view_of(out, h.shape, h.stride, out.storage_offset() + h.offset);
}

// ---------------------------------------------------------------- Python

py::object SavedTensors::owner() {
  py::object o = owner_();
  TORCH_CHECK(!o.is_none(), "effmem: the activation compressor these saves belong to is gone");
  return o;
}

void SavedTensors::version_error(int64_t now, int64_t saved, at::ScalarType dtype, const std::vector<int64_t>& shape,
                                 at::Device device) {
  // compress/hooks.py's _version_error raises torch's RuntimeError, worded as torch words it
  py::module_::import("effmem.compress.hooks").attr("_version_error")(now, saved, dtype, shape, device);
  TORCH_CHECK(false, "effmem: a saved tensor was modified in place after it was saved");
}

}  // namespace effmem::saved
