"""bench/bench_delay_warmup.py, bench/bench_host_update.py and bench/sim_delay_correction.py run end to end (tiny
sizes) and print their rows."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks import their neighbour common.py


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_delay_warmup_prints_each_row_per_seed_and_the_mean_gaps(capsys):
    load("bench_delay_warmup").main(["--steps", "3", "--seeds", "2", "--warmups", "0", "--correction-warmups", "0",
                                     "--noise", "--state-bits-8", "--policies", "fast", "min"])
    out = capsys.readouterr().out
    assert out.count("final loss (mean of the last 10): exact OffloadAdam") == 2
    rows = ("delay, delay_warmup=0", "delay + delay_correction, delay_warmup=0", "torch AdamW, exact gradients",
            "exact, state_bits=8", 'exact, apply_activation_policy "fast"', 'exact, apply_activation_policy "min"')
    summary = out[out.index("over 2 seeds"):]
    for row in rows:
        assert len(re.findall(re.escape(row) + r".*\(([+-]\d+\.\d+)%\)$", out, re.M)) == 2   # one per seed
        assert re.search(re.escape(row) + r".* [+-]\d+\.\d+%  \([+-]\d+\.\d+% \.\. [+-]\d+\.\d+%\)", summary)


def test_host_update_prints_a_ratio_per_moment_format(capsys):
    load("bench_host_update").main(["--numel", "4096", "--repeat", "2"])
    out = capsys.readouterr().out
    assert len(re.findall(r"delay_correction=True .* (\d+\.\d+)x the same without it", out)) == 2
    assert len(re.findall(r"delay_correction=False .* ms", out)) == 2


def test_both_write_json_with_the_environment(tmp_path):
    """docs/offload_adam.md quotes both scripts' figures: their runs are kept as JSON with device, torch and commit, the
    host update's rows with their bandwidth against a copy timed in the same rounds."""
    import json
    load("bench_host_update").main(["--numel", "4096", "--repeat", "2", "--json", str(tmp_path / "h.json")])
    load("bench_delay_warmup").main(["--steps", "3", "--warmups", "0", "--correction-warmups",
                                     "--json", str(tmp_path / "d.json")])
    host, delay = (json.loads((tmp_path / f).read_text()) for f in ("h.json", "d.json"))
    for data in (host, delay):
        assert data["env"]["torch_version"] and data["env"]["git_commit"] and data["env"]["device_name"]
    assert len(host["rows"]) == 4 and host["copy_gb_per_s"] > 0
    for row in host["rows"]:
        assert abs(row["bw_fraction"] - row["gb_per_s"] / host["copy_gb_per_s"]) < 1e-12
        assert row["gb_per_s"] * row["median_ms"] / 1e3 * 1e9 == pytest.approx(row["bytes_per_element"] * 4096)
    assert len(delay["exact_final_loss"]) == 1 and list(delay["relative_gap_to_exact"]) == ["delay, delay_warmup=0"]


def test_the_simulation_predicts_from_the_step_after_its_warm_up(capsys, tmp_path):
    """A warm-up of N exact steps leaves the forwards up to step N + 1 exact (step N's update writes the first
    prediction, read by forward N + 2, as the engine's delay_warmup); the prediction given the step's own
    learning rate and clip factor is another one."""
    import json
    sim = load("sim_delay_correction")
    args = ["--seeds", "1", "--steps", "6", "--layers", "1", "--d-model", "48", "--seq-len", "16", "--batch-size", "4"]
    sim.main(args + ["--variants", "correction", "correction+warmup4", "correction+warmup5", "correction+lr+clip",
                     "--json", str(tmp_path / "s.json")])
    loss = json.loads((tmp_path / "s.json").read_text())["final_loss"]
    assert list(loss) == ["exact", "correction", "correction+warmup4", "correction+warmup5", "correction+lr+clip"]
    assert loss["correction+warmup5"] == loss["exact"]
    assert len({loss[k][0] for k in ("exact", "correction", "correction+warmup4", "correction+lr+clip")}) == 4
    assert "gap to exact over 1 seeds" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sim.main(args + ["--variants", "correction+v"])
