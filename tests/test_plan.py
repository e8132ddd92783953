"""effmem plan: the classic worked examples, the JSON contract, the command, the candidates (apply() and verify()
in test_plan_apply.py)."""
import dataclasses
import json
import sys
import time

import pytest
import torch

import effmem
from effmem.cli import main
from effmem.demo_model import ByteGPT, GPTConfig
from effmem.plan import costs, loss_buffers
from effmem.plan.hf_config import preset_names
from effmem.plan.report import code_for

pytest.importorskip("transformers")

GB = 1e9
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def llama(hidden, layers, inter, vocab, heads=32):
    return dict(model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab)


def states(c) -> dict:
    return c.cost.states


def pick_of(plan, **want):
    """The first candidate whose config has these fields (float32 Adam moments unless asked)."""
    want.setdefault("state_bits", 32)
    want.setdefault("device_accumulation", 0)
    want.setdefault("device_state", 0)
    for c in plan.candidates:
        if all(getattr(c.config, k) == v for k, v in want.items()):
            return c
    raise AssertionError(f"no candidate with {want}")


def close(a, b, rel=0.02):
    return abs(a - b) <= rel * abs(b)


def test_7b_fp32_adam_needs_112_gb_of_model_states():
    # Llama-2-7B's shape with a 64,000-token vocabulary: 7.00e9 parameters, the worked example's "7B".
    p = effmem.plan(llama(4096, 32, 11008, 64000), batch=1, seq=512, gpu_memory="80GB")
    assert close(p.params, 7e9, 0.001)
    s = states(pick_of(p, precision="fp32", optimizer="gpu"))
    assert close(s["weights"] / GB, 28) and close(s["grads"] / GB, 28) and close(s["optimizer"] / GB, 56)
    assert close(sum(s.values()) / GB, 112)


def test_bf16_with_fp32_master_is_16_bytes_per_parameter_and_the_2b_example():
    p = effmem.plan(llama(2048, 36, 5632, 32000), batch=1, seq=512, gpu_memory="80GB")
    assert close(p.params, 2e9)
    s = states(pick_of(p, precision="bf16", optimizer="gpu"))
    assert sum(s.values()) == 16 * p.params
    for part, gb in (("weights", 4), ("grads", 4), ("optimizer", 16), ("master", 8)):
        assert close(s[part] / GB, gb), (part, s[part])


def test_mixtral_does_not_fit_44_gb_whole_but_six_layers_of_two_experts_do():
    whole = effmem.plan("mixtral-8x7b", batch=1, seq=512, gpu_memory="44GB", host_memory="1TB", gpus=1)
    assert whole.best is None and not any(c.fits for c in whole.candidates)
    assert "does not fit" in whole.candidates[0].why
    trained = r"model\.layers\.[0-5]\.mlp\.experts\.#0:2,model\.layers\.[0-5]\.mlp\.gate\."
    part = effmem.plan("mixtral-8x7b", batch=1, seq=512, gpu_memory="44GB", gpus=1, trainable=trained)
    assert close(part.trainable_params / GB, 2.114, 0.01)
    s = states(pick_of(part, precision="bf16", optimizer="gpu"))
    model_states = 2 * part.trainable_params + s["grads"] + s["optimizer"] + s["master"]
    for got, want in ((2 * part.trainable_params, 4.23), (s["grads"], 4.23), (s["optimizer"], 16.9),
                      (s["master"], 8.46), (model_states, 33.8)):
        assert close(got / GB, want), (got, want)


def test_json_contract_and_pick_is_fastest_that_fits():
    p = effmem.plan("gpt2", batch=4, seq=128, gpu_memory="16GB", host_memory="64GB")
    d = json.loads(json.dumps(p.as_dict()))
    for key in ("model", "params", "trainable_params", "gpu_memory", "candidates", "best"):
        assert key in d
    assert d["params"] == sum(x.numel for x in p.spec.params)
    for c in d["candidates"]:
        assert set(c) >= {"name", "fits", "peak_bytes", "host_bytes", "step_time_s", "parts", "why"}
        assert set(c["parts"]) >= {"weights", "grads", "master", "optimizer", "activations", "logits",
                                   "temporary", "reserve"}
        assert c["peak_bytes"] == sum(c["parts"].values())
        # no part of a step negative (the fused kernels' saving was "activations" < 0): off "elementwise"
        assert all(v >= 0 for v in c["time_parts"].values()), c["time_parts"]
        assert c["step_time_s"] == pytest.approx(sum(c["time_parts"].values()))
        assert c["why"]
    fits = [c for c in d["candidates"] if c["fits"]]
    # Of those within 3% of the fastest, the one that changes the numbers least (8-bit activations or moments),
    # then one without host memory, then the fastest; of equally fast ones ("fast" and fast_offload when the
    # link hides the copies) the one with less on the host, then the smaller.
    fastest = min(c["step_time_s"] for c in fits)
    lossy = ("fast", "fast_offload", "checkpoint8", "compress8", "compress4")
    near = [c for c in fits if c["step_time_s"] <= 1.03 * fastest]
    assert d["best"] == min(near, key=lambda c: ((c["activations"] in lossy) + (c["state_bits"] == 8),
                                                 c["host_bytes"] > 0, float(f"{c['step_time_s']:.9g}"), c["host_bytes"],
                                                 c["peak_bytes"]))["name"]
    assert d["candidates"][0]["name"] == d["best"] and d["best"] == "bf16+fused-ce+mb4x1", d["best"]
    faster = [c for c in fits if float(f"{c['step_time_s']:.9g}") < float(f"{d['candidates'][0]['step_time_s']:.9g}")]
    assert faster and all("faster than the pick (within 3%) but" in c["why"] for c in faster)
    # the pick's own reason says so (it said "fastest that fits")
    assert d["candidates"][0]["why"].startswith("the pick: ") and "slower than the fastest that fits (within 3%" \
        in d["candidates"][0]["why"], d["candidates"][0]["why"]
    assert all(c["peak_bytes"] <= 0.95 * d["gpu_memory"] for c in fits)
    # every rejected candidate says why: the bytes it is short of, or what rules it out
    rejected = [c for c in d["candidates"] if not c["fits"]]
    assert rejected and all(c["why"].startswith("does not fit: needs ") and " GB over " in c["why"]
                            or c["why"].startswith(("overlap mode rules out", "not possible here"))
                            for c in rejected), [c["why"] for c in rejected]


def test_a_smaller_gpu_rejects_what_does_not_fit_and_says_by_how_much():
    big = effmem.plan("llama-7b", batch=8, seq=2048, gpu_memory="80GB", host_memory="256GB")
    small = effmem.plan("llama-7b", batch=8, seq=2048, gpu_memory="24GB", host_memory="256GB")
    plain = pick_of(small, precision="bf16", activations="none", optimizer="gpu")
    assert not plain.fits and "GB over" in plain.why
    assert small.pick.cost.peak_bytes <= 0.95 * 24 * GB
    assert big.pick.step_time_s <= small.pick.step_time_s


def test_when_nothing_fits_the_closest_is_the_fewest_bytes_short():
    """70B over 8 x 80 GB with 25 GB of host memory: nothing fits. The lowest GPU peak belongs to an offload
    candidate over 1 TB short of host memory; the closest is one 17 GB over the GPU budget (8-bit moments
    sharded over the GPUs), and the report says so."""
    from effmem.plan.report import format_plan
    p = effmem.plan("llama-70b", batch=8, seq=2048, gpus=8, gpu_memory="80GB", host_memory="25GB", device="cuda")
    assert p.pick is None and all(c.short_bytes > 0 for c in p.candidates)
    closest = p.candidates[0]
    assert closest.short_bytes == min(c.short_bytes for c in p.candidates)
    lowest_peak = min(p.candidates, key=lambda c: c.cost.peak_bytes)
    assert lowest_peak.short_bytes > 10 * closest.short_bytes, (lowest_peak.name, closest.name)
    assert closest.config.state_bits == 8 and closest.short_bytes < 20 * GB
    assert f"Nothing fits. Closest: {closest.name}: " in format_plan(p)
    assert p.as_dict()["candidates"][0]["short_bytes"] == closest.short_bytes
    # short of both: the reason names both
    both = next(c for c in p.candidates if c.config.optimizer != "gpu" and c.cost.peak_bytes > 0.95 * 80 * GB)
    assert "GB over the 76.0 GB budget" in both.why and "of host memory" in both.why, both.why


def test_step_time_grows_with_the_tokens_in_every_mode():
    """Twice the tokens at the same micro-batch is never faster: backward hides OffloadAdam's downloads
    and (overlap) its updates once, not once each (the overlap mode's time fell with longer sequences).
    Where the shorter step waits for the host issuing ops (step_model.host_s), the windows that hide the offload
    work are the device's stretched to the host's time, whose shares of forward and backward move a little
    with the tokens: there 2% (1.1% seen), and never more than 1e-12 elsewhere."""
    def times(seq):
        p = effmem.plan("llama-1b", batch=8, seq=seq, gpu_memory="80GB", host_memory="128GB", device="cuda",
                        clipping=False)
        return {c.name: c for c in p.candidates}
    short, long = times(512), times(1024)
    same = set(short) & set(long)
    assert len(same) > 50 and any("overlap" in n for n in same)
    assert any(short[n].time_parts["host"] > 0 for n in same) and any(short[n].time_parts["host"] == 0 for n in same)
    for name in same:
        slack = 0.02 if short[name].time_parts["host"] > 0 else 1e-12
        assert long[name].step_time_s >= short[name].step_time_s * (1 - slack), (
            name, short[name].time_parts, long[name].time_parts)


def test_sequence_longer_than_learned_positions_and_paths_named_like_presets(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"seq: 2048 tokens is more than this model's learned positions "
                                         r"\(n_positions = 1024\)"):
        effmem.plan("gpt2", seq=2048)
    assert effmem.plan("gpt2", batch=1).seq == 1024   # the default, where the positions end
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, '
                                        '"n_positions": 128, "vocab_size": 256}')
    monkeypatch.chdir(tmp_path)
    assert effmem.plan("gpt2", batch=1, device="cpu").params < 10 ** 6   # the folder, not the preset
    with pytest.raises(ValueError, match="trainable: an empty pattern"):
        effmem.plan("gpt2", trainable="h\\.0\\.,", device="cpu")


def test_70b_preset_plans_in_under_two_seconds():
    effmem.plan("llama-7b", batch=1, seq=128)  # imports transformers and warms its model classes
    times = []
    for _ in range(3):   # the best of three: the other test worker shares the two cores (2.08 s once in CI)
        t0 = time.perf_counter()
        p = effmem.plan("llama-70b", batch=8, seq=4096, gpus=8, gpu_memory="80GB", host_memory="2TB")
        times.append(time.perf_counter() - t0)
        if times[-1] < 2.0:
            break
    assert min(times) < 2.0, times
    assert close(p.params / GB, 68.98, 0.001)
    assert p.best is not None


def test_presets_all_plan():
    for name in preset_names():
        p = effmem.plan(name, batch=1, seq=256, gpu_memory="80GB", host_memory="1TB")
        assert p.params > 1e8 and p.candidates, name


def test_command_writes_json_chart_and_code(tmp_path, capsys):
    out, svg = tmp_path / "plan.json", tmp_path / "plan.svg"
    rc = main(["plan", "gpt2", "--batch", "4", "--seq", "128", "--gpu-memory", "16GB", "--host-memory", "64GB",
               "--json", str(out), "--chart", str(svg)])
    text = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["best"] in text and ("effmem.FusedAdam" in data["code"] or "OffloadAdam" in data["code"])
    assert svg.read_text().startswith("<svg") and "(pick)" in svg.read_text()
    with pytest.raises(SystemExit):
        main(["plan", "gpt2", "--gpu-memory", "lots"])
    assert "error: --gpu-memory: expected a size" in capsys.readouterr().err   # the flag, not the argument


def test_png_chart_draws_the_progression_and_the_pick(tmp_path):
    """--chart x.png (matplotlib): a real PNG; the progression's bars keep the standard loss and float32
    moments, each differing from plain bf16 by what its name says; the pick is drawn too."""
    from effmem.plan.chart import chart_rows, write_chart
    p = effmem.plan("llama-7b", batch=8, seq=4096, gpu_memory="80GB", host_memory="128GB")
    names = [n for n, _ in chart_rows(p)]
    assert names[0].startswith("fp32+mb") and names[1].startswith("bf16+mb") and names[-1].endswith("(pick)")
    assert not any("fused-ce" in n or "adam8" in n for n in names[:-1])
    png = tmp_path / "plan.png"
    assert write_chart(p, str(png)) == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="expected a path ending in .svg or .png"):
        write_chart(p, str(tmp_path / "plan.pdf"))


def test_fused_loss_with_gradients_in_forward_is_a_candidate_of_its_own():
    """For bf16 weights on a GPU, effmem.fuse_linear_cross_entropy(model, grad_in_forward=True): one
    product fewer than the default fused loss (which makes the logits again in backward), a float32 sum of
    the head's gradient and a chunk of logits in forward (loss_buffers.fused_ce_gif_buffers), and the head's
    gradients kept from forward to backward. A float32 head makes them in forward by default: no twin."""
    cfg = dict(TINY, vocab_size=32000)
    p = effmem.plan(cfg, batch=8, seq=512, accum=1, gpu_memory="80GB", host_memory="64GB", device="cuda")
    gif, fused = (pick_of(p, precision="bf16", activations="none", optimizer="gpu", micro_batch=8, loss=loss)
                  for loss in ("fused_gif", "fused"))
    assert "fused-ce-grad-in-fwd" in gif.name and not any(
        c.config.loss == "fused_gif" for c in p.candidates if c.config.precision == "fp32")
    tokens, hidden, vocab = 8 * 512, cfg["hidden_size"], cfg["vocab_size"]
    head_s = gif.time_parts["compute"] / fused.time_parts["compute"]
    # the device's time (this tiny model's steps wait for the host, which issues the same ops either way)
    assert gif.step_time_s - gif.time_parts["host"] < fused.step_time_s - fused.time_parts["host"] and head_s < 1
    assert gif.cost.parts["temporary"] >= loss_buffers.fused_ce_gif_buffers(tokens, vocab, hidden, "cuda")
    assert gif.cost.parts["grads"] - fused.cost.parts["grads"] >= 2 * vocab * hidden   # the head's bf16 gradient
    assert "grad_in_forward=True" in code_for(gif.config) and "grad_in_forward" not in code_for(fused.config)
    # the H200's measurement at 16k tokens x 128k x 4096: 2.446 GiB of extra peak
    assert loss_buffers.fused_ce_gif_buffers(16384, 128256, 4096, "cuda") / 2 ** 30 == pytest.approx(2.446, rel=0.01)


def test_calibrate_measures_this_machine_and_later_plans_use_it(tmp_path, monkeypatch):
    from effmem.plan import rates as rates_mod
    monkeypatch.setattr(rates_mod, "_CACHE", tmp_path / "plan_rates.json")
    r = rates_mod.calibrate(torch.device("cpu"))
    assert r.device == "cpu" and r.matmul_flops > 1e8 and r.memory_bw > 1e8 and r.host_adam > 1e6
    assert json.loads((tmp_path / "plan_rates.json").read_text())["cpu"]["matmul_flops"] == r.matmul_flops
    p = effmem.plan("gpt2", batch=2, seq=64, device="cpu")
    assert p.rates == r and "calibrate" in p.rates.source
    # a second calibration's source names the shipped rates, not the first (nested deeper each run: a reviewer)
    assert rates_mod.calibrate(torch.device("cpu")).source.count("calibrate") == 1


def test_small_steps_wait_for_the_host_issuing_ops():
    """On a GPU, a micro-batch whose device work is shorter than the host's issuing of its ops takes the
    host's time (plan/step_model.py host_s): TinyLlama at 1 x 128 tokens, not at 8 x 2048; selective
    checkpointing's policy costs host time per op, full checkpointing only the recomputed layers' ops.
    The CPU defaults count no host time (their matmul rate is an effective one); calibrated CPU rates (peak
    products) add each op's host time to the work, as a CPU runs an op as its host issues it."""
    small = effmem.plan("tinyllama-1.1b", batch=1, seq=128, device="cuda", gpu_memory="80GB", host_memory="128GB")
    big = effmem.plan("tinyllama-1.1b", batch=8, seq=2048, device="cuda", gpu_memory="80GB", host_memory="128GB")
    host = {a: small.candidate("bf16+" + ("" if a == "none" else a + "+") + "mb1x1").time_parts["host"]
            for a in ("none", "checkpoint", "selective")}
    assert 0 < host["none"] < host["checkpoint"] < host["selective"], host
    assert big.candidate("bf16+mb8x1").time_parts["host"] == 0
    cpu = effmem.plan("gpt2", batch=1, seq=32, device="cpu")
    assert all(c.time_parts.get("host", 0) == 0 for c in cpu.candidates)
    from effmem.plan.rates import CPU_DEFAULT
    calibrated = effmem.plan("gpt2", batch=1, seq=32, device="cpu", rates=dataclasses.replace(CPU_DEFAULT,
                                                                                             host_op_s=10e-6))
    for c in calibrated.candidates:   # added whole: no device to overlap with, however long its work
        ops = calibrated.candidate(c.name)
        assert ops.time_parts["host"] > 0
        assert ops.step_time_s == pytest.approx(cpu.candidate(c.name).step_time_s + ops.time_parts["host"])


def test_host_time_per_op_is_measured_with_or_without_transformers(monkeypatch):
    from effmem.plan.rates import _host_op_s
    with_hf = _host_op_s(torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers raises ImportError
    without = _host_op_s(torch.device("cpu"))
    assert 1e-7 < with_hf < 1e-3 and 1e-7 < without < 1e-3, (with_hf, without)


def test_bench_plan_runs_its_loop_on_the_cpu(tmp_path):
    """bench/bench_plan.py's GPU run is one device call; its loop is run here so it cannot fail on a typo."""
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "plan.json"
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_plan.py"
    proc = subprocess.run([sys.executable, str(bench), "--smoke", "--steps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["rows"] and all(r["status"] == "ok" for r in data["rows"]) and len(data["targets"]) == 5
    assert data["partial"] is False and data["env"]["torch_version"]


def test_offload_async_and_8bit_moments_are_candidates():
    """OffloadAdam(async_step=True): the update behind the next forward, so never slower than plain
    OffloadAdam, and a second gradient staging on the host; state_bits=8: 6 B/param less of state."""
    p = effmem.plan("llama-7b", batch=8, seq=2048, gpu_memory="80GB", host_memory="256GB", device="cuda")
    by = {(c.config.optimizer, c.config.state_bits, c.config.activations, c.config.loss, c.config.micro_batch):
          c for c in p.candidates if c.config.precision == "bf16"}
    key = ("checkpoint", "standard", 8)
    plain, quick = by[("offload", 32) + key], by[("offload_async", 32) + key]
    assert quick.step_time_s < plain.step_time_s
    assert quick.cost.host_bytes - plain.cost.host_bytes == 2 * p.trainable_params  # the second bf16 staging
    eight = by[("offload_async", 8) + key]
    # a float32 scale per moment per 256 elements of each tensor, as the optimizers allocate them
    scales = 8 * sum(-(-n // 256) for n in (q.numel for q in p.spec.params))
    assert quick.cost.host_bytes - eight.cost.host_bytes == 6 * p.trainable_params - scales
    assert "opt.attach(model)" in code_for(quick.config) and "state_bits=8" in code_for(eight.config)


def test_device_accumulation_is_a_candidate_where_the_link_is_the_bottleneck():
    """OffloadAdam under accumulation may keep gradients on the GPU and send them once per step (issue 12,
    item 3): the plan offers it with as many bytes as the room under the budget holds, counts them at the
    start of backward, and counts the link once instead of once per micro-batch; where backward hides the
    link anyway it is no faster and the plan keeps the candidate that holds less."""
    p = effmem.plan("llama-1b", batch=16, seq=512, accum=8, gpu_memory="80GB", host_memory="256GB",
                    device="cuda")
    base = pick_of(p, precision="bf16", activations="none", optimizer="offload", loss="standard")
    kept = next(c for c in p.candidates if c.config == dataclasses.replace(
        base.config, device_accumulation=c.config.device_accumulation) and c.config.device_accumulation)
    t = p.trainable_params
    assert kept.config.device_accumulation == 2 * t  # all of them: the room is there
    assert kept.cost.parts["grads"] - base.cost.parts["grads"] == 2 * t
    assert "grads-on-gpu" in kept.name and kept.fits
    # Seven micro-batches' sends fewer, less what their backward hid.
    saved = base.time_parts["optimizer"] - kept.time_parts["optimizer"]
    assert 0 < saved <= 7 * 2 * t / p.rates.link_bw
    assert f"device_accumulation={2 * t}" in code_for(kept.config) and "opt.accumulating()" in code_for(kept.config)
    assert p.as_dict()["candidates"][p.candidates.index(kept)]["device_accumulation"] == 2 * t
    # A tight GPU: only as many whole buckets as fit, or none.
    tight = effmem.plan("llama-1b", batch=16, seq=512, accum=8, gpu_memory=base.cost.peak_bytes / 0.95 + 40e6,
                        host_memory="256GB", device="cuda")
    part = next(c for c in tight.candidates if c.config == dataclasses.replace(
        base.config, device_accumulation=c.config.device_accumulation) and c.config.device_accumulation)
    # 40 MB of room: the engine's first buckets (backward order) while they fit
    sizes = costs.offload_buckets(q.numel for q in tight.spec.params if q.trainable)
    prefix = [2 * sum(sizes[:j]) for j in range(1, len(sizes) + 1)]
    assert part.fits and part.config.device_accumulation == max(b for b in prefix if b <= 38e6)
    # One micro-batch: nothing to accumulate, no such candidate.
    one = effmem.plan("llama-1b", batch=2, seq=512, accum=1, gpu_memory="80GB", device="cuda")
    assert not any(c.config.device_accumulation for c in one.candidates)


def test_fast_offload_moves_the_hidden_layers_codes_to_the_host():
    """fast_offload (a GPU candidate): the "fast" policy with the 8-bit codes of the first layers in host
    memory, as many layers as the link hides behind their forward (activations.budget.hidden_layers on
    the plan's rates): their codes leave the GPU's activations for the host's, at the same step time."""
    from effmem.activations.budget import hidden_layers
    p = effmem.plan("llama-7b", batch=8, seq=2048, accum=8, gpu_memory="80GB", host_memory="256GB", device="cuda")
    fast = pick_of(p, precision="bf16", activations="fast", optimizer="offload", loss="standard")
    off = pick_of(p, precision="bf16", activations="fast_offload", optimizer="offload", loss="standard")
    moved = off.cost.host_bytes - fast.cost.host_bytes
    act = off.cost.parts["activations_by_kind"]
    assert moved >= fast.cost.parts["activations_by_kind"]["block"] - act["block"] > 0
    assert off.step_time_s == fast.step_time_s
    # 31 of 32 layers: the last one's backward comes first, there is nothing to hide its copies behind
    assert hidden_layers(32, 1.0, 1, 1e9) == 31
    assert act["block"] == off.cost.activation_budget  # the solver may fill its budget: that is counted
    assert off.cost.activation_budget < 0.25 * fast.cost.parts["activations_by_kind"]["block"]  # attention out stays
    assert f"memory_budget={off.cost.activation_budget})" in code_for(off.config, "cuda",
                                                                     off.cost.activation_budget)
    assert not any(c.config.activations == "fast_offload" for c in effmem.plan(
        TINY, batch=2, seq=64, device="cpu", host_memory="8GB").candidates)  # no link on a CPU


@pytest.mark.parametrize("model", ["llama-7b", "gpt2"])
def test_formula_stands_in_where_the_trace_fails(model, monkeypatch):
    """A model the trace cannot run (here: made to fail) is planned from the closed form, and the plan says
    so; for what both describe (bf16, standard loss, kept / checkpointed / saved on the CPU), the formula's
    peaks are the trace's (within 1e-4: they count the same tensors), step times within 2% (the formula
    counts 2 FLOPs per matmul weight per token, the trace torch's own formulas). A model the formula
    does not know still fails, with the trace's own error."""
    from effmem.plan import activity
    args = dict(batch=8, seq=1024, gpu_memory="80GB", host_memory="128GB")
    traced = effmem.plan(model, **args)

    def fail(*a, **k):
        raise RuntimeError("no meta kernel for mylib::op")
    monkeypatch.setattr(activity, "trace_spec", fail)
    fb = effmem.plan(model, **args)
    assert fb.method.startswith("closed form") and "no meta kernel for mylib::op" in fb.method
    assert any("could not be traced" in n for n in fb.notes)
    assert {c.config.activations for c in fb.candidates} == {"none", "checkpoint", "checkpoint8", "save_on_cpu"}
    assert {(c.config.precision, c.config.loss) for c in fb.candidates} == {("bf16", "standard")}
    # The formula counts no elementwise traffic, so its forward is shorter and async OffloadAdam keeps a
    # different share of state on the GPU (device_state): those candidates have no twin of the same name.
    compared = 0
    for c in fb.candidates:
        if c.config.device_state:
            continue
        t = traced.candidate(c.name)
        compared += 1
        assert abs(c.cost.peak_bytes / t.cost.peak_bytes - 1) < 1e-4, c.name
        # products and attention: 2 FLOPs per matmul weight per token against torch's formulas
        assert abs(c.time_parts["compute"] / t.time_parts["compute"] - 1) < 0.02, c.name
    assert compared >= 10
    assert fb.best is not None
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="no meta kernel for mylib::op"):
        effmem.plan(ByteGPT(GPTConfig(seq_len=32, n_layer=2, d_model=32, n_head=2)), batch=2, seq=32, device="cpu")



@pytest.mark.parametrize("cfg", [TINY, dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            vocab_size=512)], ids=["llama", "gpt2"])
def test_fused_loss_made_in_forward_takes_the_fast_counts_of_the_default_fused_loss(cfg):
    """The fused-ce-grad-in-fwd activity is not traced under the "fast" policy (a 70B plan stays under 2 s): its
    "fast" counts are the default fused loss's with its own loss saves put in, the same as tracing it."""
    from effmem.plan.model import model_spec
    from effmem.plan.activity import Activity as _Activity
    spec = model_spec(cfg)
    standard = _Activity(spec, 64, torch.bfloat16, "cuda", None)
    fused = _Activity(spec, 64, torch.bfloat16, "cuda", None, "fused", layers_from=standard)
    derived = _Activity(spec, 64, torch.bfloat16, "cuda", None, "fused_gif", layers_from=standard, fast_from=fused)
    traced = _Activity(spec, 64, torch.bfloat16, "cuda", None, "fused_gif", layers_from=standard)
    assert derived.one.one.fast is None and traced.one.one.fast is not None and derived.has_fast
    for micro in (1, 3):
        d, t = derived.model(spec, micro, 1.0), traced.model(spec, micro, 1.0)
        assert d.activations == t.activations and d.activations["fast"]["grads"] > 0
        assert (d.fast_compressed, d.fast_codes) == (t.fast_compressed, t.fast_codes)


def test_on_a_cpu_eight_bit_moments_step_at_the_cpu_kernels_rate():
    """Training on a CPU, FusedAdam runs its CPU kernel, where 8-bit moments are compute-bound (0.57x the
    float32 moments' rate, bench/results/cpu_adam_avx2.json): the plan counted the GPU kernel's bytes instead,
    found 8-bit moments faster, and picked them for a model that needed no memory saved."""
    p = effmem.plan(TINY, batch=2, seq=64, device="cpu", host_memory="8GB")
    exact = pick_of(p, precision="fp32", activations="none", state_bits=32, loss="standard")
    eight = pick_of(p, precision="fp32", activations="none", state_bits=8, loss="standard")
    assert eight.time_parts["optimizer"] == pytest.approx(2 * exact.time_parts["optimizer"])
    assert p.pick.config.state_bits == 32
