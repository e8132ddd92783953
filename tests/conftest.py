import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Device-generic tests run on both; the CUDA one is marked, so it is skipped
# (and counted as skipped) without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


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
