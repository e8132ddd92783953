"""bench/bench_delay_warmup.py and bench/bench_host_update.py run end to end (tiny sizes) and print their rows."""
import importlib.util
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks import their neighbour common.py


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_delay_warmup_prints_each_row_per_seed_and_the_mean_gaps(capsys):
    load("bench_delay_warmup").main(["--steps", "3", "--seeds", "2", "--warmups", "0", "--correction-warmups", "0",
                                     "--noise"])
    out = capsys.readouterr().out
    assert out.count("final loss (mean of the last 10): exact OffloadAdam") == 2
    rows = ("delay, delay_warmup=0", "delay + delay_correction, delay_warmup=0", "torch AdamW, exact gradients")
    summary = out[out.index("over 2 seeds"):]
    for row in rows:
        assert len(re.findall(re.escape(row) + r".*\(([+-]\d+\.\d+)%\)$", out, re.M)) == 2   # one per seed
        assert re.search(re.escape(row) + r".* [+-]\d+\.\d+%  \([+-]\d+\.\d+% \.\. [+-]\d+\.\d+%\)", summary)


def test_host_update_prints_a_ratio_per_moment_format(capsys):
    load("bench_host_update").main(["--numel", "4096", "--repeat", "2"])
    out = capsys.readouterr().out
    assert len(re.findall(r"delay_correction=True .* (\d+\.\d+)x the same without it", out)) == 2
    assert len(re.findall(r"delay_correction=False .* ms", out)) == 2
