"""bench/bench_offload.py's step comparison on the CPU: every variant starts from the same weights and sees
the same data, so the exact modes' losses equal FusedAdam's; a variant that fails (or an anchor without
Optimizer.state, as torchao's CPUOffloadOptimizer is) costs its own row only, and the rows are saved as
each finishes, so a GPU run cut off by its time limit keeps them.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmark imports its neighbours common.py and llama.py
spec = importlib.util.spec_from_file_location("bench_offload", BENCH / "bench_offload.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


class StatelessAnchor(torch.optim.Optimizer):
    """Like torchao's CPUOffloadOptimizer: an Optimizer subclass whose __init__ never ran Optimizer's."""

    def __init__(self, params, fail=False):  # noqa: super().__init__ left out on purpose
        self.inner = torch.optim.AdamW(params, lr=bench.LR)
        self.fail = fail

    def step(self, closure=None):
        if self.fail:
            raise RuntimeError("anchor broke")
        self.inner.step()

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


def test_rows_survive_a_failing_variant_and_exact_modes_match_fused(monkeypatch):
    monkeypatch.setattr(bench, "_torchao_offload", lambda accum: lambda m: StatelessAnchor(m.parameters()))
    args = argparse.Namespace(size="tiny", batch=2, seq=32, accum=2, steps=1, warmup=1)
    rows, saves = [], []
    bench.step_comparison(args, "cpu", rows, lambda: saves.append([r["name"] for r in rows]))
    names = [r["name"] for r in rows]
    # the rows the targets read first (a run its time limit cuts off keeps them), delay_correction's new CUDA
    # kernel last (a fault there would leave every later row failing)
    assert names[:4] == ["fused", "offload_async_device_state", "offload_async", "offload"], names
    assert names[-2:] == ["torchao_offload", "offload_delay_correction"] and len(names) == 10
    assert saves == [names[:i + 1] for i in range(len(names))]  # saved after every variant
    loss = {r["name"]: r["held_out_loss"] for r in rows}
    for exact in ("offload", "offload_overlap", "offload_async", "offload_async_device_state",
                  "offload_device_accum"):
        assert loss[exact] == loss["fused"], exact   # same start, same data, same math
    # delay_correction's first step is exact, the second's gradients come from exact weights too (its first
    # prediction is read by a third forward), and the flush installs the update's own weights
    assert loss["offload_delay_correction"] == loss["fused"]
    kept = {r["name"]: r["device_state_fraction"] for r in rows if "device_state_fraction" in r}
    share = bench.DEVICE_STATE_SHARE   # a prefix of whole buckets: at most the share, not far below it
    assert share / 2 < kept.pop("offload_async_device_state") <= share and set(kept.values()) == {0.0}
    assert loss["torchao_offload"] != loss["fused"]  # torch AdamW's rounding differs, but it trained
    assert abs(loss["torchao_offload"] / loss["fused"] - 1) < 1e-3
    assert rows[-2]["device_state_bytes"] == sum(p.numel() * p.element_size()
                                                 for p in bench.llama.build("tiny", "cpu").parameters())

    monkeypatch.setattr(bench, "_torchao_offload", lambda accum: lambda m: StatelessAnchor(m.parameters(), True))

    def broken(opt, model):   # the async variants fail after a backward, leaving gradients in p.grad
        opt.close()
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(9))
        model(x, x).backward()
        raise RuntimeError("async broke")

    monkeypatch.setattr(bench, "_attached", broken)
    rows = []
    bench.step_comparison(args, "cpu", rows)
    errors = {r["name"]: r.get("error") for r in rows}
    assert errors["torchao_offload"] == "RuntimeError: anchor broke"
    assert (errors["offload_async"] == errors["offload_async_adam8"] == errors["offload_async_device_state"]
            == "RuntimeError: async broke")
    ok = {r["name"]: r["held_out_loss"] for r in rows if "error" not in r}
    assert ok["offload_device_accum"] == ok["fused"]   # the failed variants' gradients did not carry over


def test_clipped_rows_clip_where_the_mode_can(monkeypatch):
    """--clip: every variant clips by the global norm before each step with its own optimizer's norm (torch's
    for the anchor) except the overlap mode, which cannot; the exact modes still train as FusedAdam does (the
    norms agree to float32 rounding, tests/test_offload.py)."""
    monkeypatch.setattr(bench, "_torchao_offload", lambda accum: lambda m: StatelessAnchor(m.parameters()))
    norms = {}
    clipper = bench.clipper

    def recording(name, max_norm, accum):   # every norm a variant's clip returned
        clip, said = clipper(name, max_norm, accum)
        if clip is None:
            return clip, said
        return (lambda opt, model: norms.setdefault(name, []).append(float(clip(opt, model)))), said

    monkeypatch.setattr(bench, "clipper", recording)
    args = argparse.Namespace(size="tiny", batch=2, seq=32, accum=2, steps=1, warmup=1, clip=0.01)
    rows = []
    bench.step_comparison(args, "cpu", rows)
    clip = {r["name"]: r["clip"] for r in rows}
    assert clip.pop("offload_overlap") == "cannot clip" and set(clip.values()) == {0.01}
    assert set(norms) == set(clip) and all(n > 0.01 for ns in norms.values() for n in ns)   # every clip acted
    loss = {r["name"]: r["held_out_loss"] for r in rows}
    for exact in ("offload", "offload_async", "offload_device_accum"):
        assert abs(loss[exact] / loss["fused"] - 1) < 1e-5, exact



def test_a_variant_that_failed_does_not_meet_its_target(monkeypatch):
    """The CUDA targets with the GPU parts stubbed: a row that failed (out of memory) reads NOT MET with its
    error, not n/a; a row that ran is judged by its ratio."""
    monkeypatch.setattr(bench, "link_bandwidth", lambda device: {"h2d": 50.0, "d2h": 50.0})
    monkeypatch.setattr(bench, "transfer_bandwidth", lambda model, device: {"gb_per_s": 45.0})
    monkeypatch.setattr(bench.llama, "build", lambda size, device: None)

    def steps(args, device, rows, saved):
        rows += [{"name": "fused", "median_ms": 100.0, "vs_baseline": 1.0},
                 {"name": "offload_async", "error": "OutOfMemoryError: CUDA out of memory"},
                 {"name": "offload_overlap", "median_ms": 110.0, "vs_baseline": 1.1}]
    monkeypatch.setattr(bench, "step_comparison", steps)
    verdicts = []
    bench.measure_steps(argparse.Namespace(device="cuda", size="1.3b", batch=8, seq=2048, accum=4, clip=None),
                        {}, verdicts)
    met = {v["target"].split(" step")[0]: v for v in verdicts}
    failed = met["OffloadAdam (async_step: exact, clipping allowed)"]
    assert failed["met"] is False and "out of memory" in failed["failed"]["offload_async"]
    assert met["OffloadAdam (overlap)"]["met"] is True
    assert met["OffloadAdam (delay: one-step-stale gradients)"]["met"] is None   # not run: no verdict


def test_the_step_targets_are_judged_at_1_3b_only(monkeypatch):
    """The default OffloadAdam row's "<= 1.10x FusedAdam at 1.3B" read MET on a tiny model (its row name has no
    "offload_" prefix); at another size every step target is n/a, and the per-parameter memory one still counts."""
    monkeypatch.setattr(bench, "link_bandwidth", lambda device: {"h2d": 50.0, "d2h": 50.0})
    monkeypatch.setattr(bench, "transfer_bandwidth", lambda model, device: {"gb_per_s": 45.0})
    monkeypatch.setattr(bench.llama, "build", lambda size, device: None)

    def steps(args, device, rows, saved):
        rows += [{"name": "fused", "median_ms": 100.0, "vs_baseline": 1.0},
                 {"name": "offload", "median_ms": 101.0, "vs_baseline": 1.01,
                  "allocated_after_step_bytes_per_param": 2.0}]
    monkeypatch.setattr(bench, "step_comparison", steps)
    for size, step_met in (("tiny", None), ("1.3b", True)):
        verdicts = []
        bench.measure_steps(argparse.Namespace(device="cuda", size=size, batch=8, seq=2048, accum=4, clip=None),
                            {}, verdicts)
        met = {v["target"]: v["met"] for v in verdicts}
        assert met[next(t for t in met if t.startswith("OffloadAdam (default"))] is step_met, size
        assert met["OffloadAdam GPU model states <= 2.1 B/param"] is True
