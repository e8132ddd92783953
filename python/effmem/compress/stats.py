"""What compress_activations saved: bytes before and after, by dtype, by module, and what it left alone."""
from dataclasses import dataclass, field
from typing import Dict


# Kept tensors that are not activations (they live anyway): listed in skipped, left out of the totals.
NOT_ACTIVATIONS = ("parameter", "layer_input")


@dataclass
class Tally:
    count: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    def add(self, before: int, after: int, count: int = 1) -> None:
        """`count` saves of `before` bytes stored in `after`."""
        self.count += count
        self.bytes_before += before
        self.bytes_after += after


def _tally(table: Dict[str, Tally], key: str, before: int, after: int, count: int = 1) -> None:
    """table[key].add(before, after, count), the Tally made only for a new key: this runs for every saved
    tensor, and a setdefault would build (and drop) a Tally each time."""
    t = table.get(key)
    if t is None:
        t = table[key] = Tally()
    t.add(before, after, count)


@dataclass
class CompressionStats:
    """Saved-for-backward bytes seen by compress_activations.

    Filled while tensors are saved: a wrapped module's ``compress_stats``
    covers its latest forward with grad enabled, a context manager's
    ``stats`` everything saved since its ``with`` block was entered.

    Totals cover activations: every distinct tensor saved for backward except
    parameters and views of them, which cost nothing extra (autograd keeps a
    reference to the weight it already holds). A tensor saved by several ops
    is counted once (``deduplicated`` counts the extra saves); a view with
    gaps compressed through the tensor it views (q, k, v of one qkv) counts
    that tensor's bytes, the memory the view kept alive. Activations that
    were kept as they are count with equal bytes before and after, so
    ``ratio`` is what the saved activations cost after compression over what
    they would have cost without it.

    ``skipped`` maps each reason a tensor was kept as it is to a Tally whose
    bytes_before == bytes_after; "parameter" and "layer_input" are listed
    there but left out of the totals. The reasons: parameter (a parameter or a view of one, any
    leaf tensor that requires grad, or a buffer of the model when
    compress_activations knows the model),
    parameter_copy (autocast's cast of a
    weight), excluded_module, excluded_predicate, unsupported (tensor
    subclasses, sparse or meta tensors), integer, dtype (float64, float8...),
    small (under min_numel), exact (attention log-sum-exp, normalisation
    statistics), row_statistic (last dim of 1 or 2: per-row statistics such as
    a decomposed norm's rstd), overlapping (expanded views), strided_view (a
    view with gaps into a tensor more than 4x its size, or whose runs of
    elements no group of 32 or more fits), no_gain; and under
    the "fast" activation policy: layer_input (a decoder layer's other
    inputs, rotary tables and masks), statistic (fewer than hidden/8 values
    per token), exponential (exp's output, whose values span orders of
    magnitude: Mamba2's decays); and under both, attention_output (a fused attention's output,
    which its backward reads beside the exact log-sum-exp) and compared (the input of amax,
    max(), median(), an infinity norm..., whose backward looks for the elements equal to the result). Saves
    of an output that policy rebuilds in backward store nothing and are counted in ``deduplicated``.
    """
    total_bytes_before: int = 0
    total_bytes_after: int = 0
    num_compressed: int = 0
    deduplicated: int = 0
    by_dtype: Dict[str, Tally] = field(default_factory=dict)
    by_module: Dict[str, Tally] = field(default_factory=dict)
    skipped: Dict[str, Tally] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """total_bytes_after / total_bytes_before (1.0 when nothing was saved)."""
        return self.total_bytes_after / self.total_bytes_before if self.total_bytes_before else 1.0

    @property
    def bytes_saved(self) -> int:
        """Bytes the compression saved in the latest forward (before less after)."""
        return self.total_bytes_before - self.total_bytes_after

    @property
    def num_skipped(self) -> int:
        """Saves kept as they are, whatever the reason (the reasons: ``skipped``)."""
        return sum(t.count for t in self.skipped.values())

    def reset(self) -> None:
        """Every count back to zero (a new forward's)."""
        self.total_bytes_before = self.total_bytes_after = self.num_compressed = self.deduplicated = 0
        self.by_dtype.clear()
        self.by_module.clear()
        self.skipped.clear()

    def record_compressed(self, dtype: str, module: str, before: int, after: int) -> None:
        """One save of `before` bytes stored compressed in `after`."""
        self.add("compressed", dtype, module, 1, before, after)

    def record_extra(self, dtype: str, module: str, nbytes: int) -> None:
        """Bytes stored beside a compressed save, not saved by autograd itself (a ReLU's exact mask)."""
        self._record(dtype, module, 0, nbytes, count=0)

    def record_kept(self, reason: str, dtype: str, module: str, nbytes: int) -> None:
        """One save of `nbytes` kept as it is, for `reason`."""
        self.add(reason, dtype, module, 1, nbytes, nbytes)

    def _record(self, dtype: str, module: str, before: int, after: int, count: int = 1) -> None:
        self.total_bytes_before += before
        self.total_bytes_after += after
        _tally(self.by_dtype, dtype, before, after, count)
        _tally(self.by_module, module, before, after, count)

    def add(self, kind: str, dtype: str, module: str, count: int, before: int, after: int) -> None:
        """`count` saves at once: compressed ("compressed"), deduplicated ("deduplicated") or kept as they are
        (any other kind: the reason)."""
        if kind == "compressed":
            self.num_compressed += count
            self._record(dtype, module, before, after, count)
        elif kind == "deduplicated":
            self.deduplicated += count
        else:
            _tally(self.skipped, kind, before, after, count)
            if kind not in NOT_ACTIVATIONS:
                self._record(dtype, module, before, after, count)

    def as_dict(self) -> dict:
        """Plain JSON values: totals, ratio and the three breakdowns."""
        def tallies(d):
            return {k: vars(v).copy() for k, v in d.items()}
        return {"total_bytes_before": self.total_bytes_before, "total_bytes_after": self.total_bytes_after,
                "ratio": self.ratio, "num_compressed": self.num_compressed, "num_skipped": self.num_skipped,
                "deduplicated": self.deduplicated, "by_dtype": tallies(self.by_dtype),
                "by_module": tallies(self.by_module), "skipped": tallies(self.skipped)}

    def format(self, max_modules: int = 12) -> str:
        """A small text table: totals, then by dtype, by module (largest first) and kept-as-is reasons."""
        def mib(n):
            return f"{n / 2**20:.2f} MiB"
        rows = [("saved activations", f"{self.num_compressed + self.num_skipped - self._param_count()}",
                 mib(self.total_bytes_before), mib(self.total_bytes_after), f"{self.ratio:.3f}")]
        for name, d in (("dtype", self.by_dtype), ("module", self.by_module)):
            items = sorted(d.items(), key=lambda kv: -kv[1].bytes_before)
            for key, t in items[:max_modules]:
                rows.append((f"  {name} {key}", str(t.count), mib(t.bytes_before), mib(t.bytes_after),
                             f"{t.bytes_after / t.bytes_before:.3f}" if t.bytes_before else "-"))
            if len(items) > max_modules:
                rest = items[max_modules:]
                rows.append((f"  ({len(rest)} more {name}s)", str(sum(t.count for _, t in rest)),
                             mib(sum(t.bytes_before for _, t in rest)), mib(sum(t.bytes_after for _, t in rest)), ""))
        for reason, t in sorted(self.skipped.items()):
            label = f"  kept: {reason}" + (" (not in totals)" if reason == "parameter" else "")
            rows.append((label, str(t.count), mib(t.bytes_before), mib(t.bytes_after), "1.000"))
        if self.deduplicated:
            rows.append(("  deduplicated saves", str(self.deduplicated), "", "", ""))
        header = ("", "tensors", "before", "after", "ratio")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
        fmt = [lambda c, w: c.ljust(w)] + [lambda c, w: c.rjust(w)] * 4
        lines = ["  ".join(f(c, w) for f, c, w in zip(fmt, row, widths)).rstrip() for row in [header] + rows]
        return "\n".join(lines)

    def _param_count(self) -> int:
        t = self.skipped.get("parameter")
        return t.count if t else 0

    def __str__(self) -> str:
        return self.format()
