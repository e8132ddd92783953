import contextlib
import os

import pytest
import torch

# The README's test command runs two pytest-xdist workers. Each gets its share of the cores as torch
# threads (and its subprocesses as OpenMP threads): two workers of two threads each on CI's two cores
# made OpenMP's waiting threads compete, and the suite took 18m48s against 15m52s in one process; with
# one thread per worker 10m49s, and 9m38s with each test file kept on one worker (--dist loadfile: a
# module's fixtures are built once). Tests of multithreaded code set their thread counts themselves.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _share = max(1, _cores // _WORKERS)
    if torch.get_num_threads() > _share:
        os.environ["OMP_NUM_THREADS"] = str(_share)
        torch.set_num_threads(_share)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # The marker, not the keyword: a parametrize id of "cuda" (say, a setting's name) is a keyword too,
        # and skipped a CPU test silently.
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# Device-generic tests run on both; the CUDA one is marked, so it is skipped
# (and counted as skipped) without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@contextlib.contextmanager
def cpu_isa(name: str):
    """effmem's CPU kernels of one vector unit within (scalar, avx2, avx512), the machine's choice after."""
    import effmem
    previous = effmem._C.cpu_isa()
    effmem._C.set_cpu_isa(name)
    try:
        yield
    finally:
        effmem._C.set_cpu_isa(previous)


def cpu_isas():
    """The vector units this machine runs: each has kernels of its own (csrc/cpu/isa_*.cpp)."""
    import effmem
    return effmem._C.supported_cpu_isas().split(",")


def same(a, b) -> bool:
    """Equal element for element, NaN equal to NaN (torch.equal says NaN != NaN)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    # The quantisation seeds that effmem draws from a process-wide counter: reset too, so a test's
    # stochastic rounding does not depend on which tests ran before it in the same process.
    import itertools
    from effmem.compress import functions
    functions._SEEDS = itertools.count()


@pytest.fixture(scope="module")
def corpus():
    """Training bytes for the small GPTs of the compress tests (1 MiB of stdlib source)."""
    from effmem import demo_model
    return demo_model.split_corpus(demo_model.stdlib_corpus(max_bytes=1 << 20))[0]
