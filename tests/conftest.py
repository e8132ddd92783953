import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def devices():
    """Devices to run the device-generic tests on: CPU always, CUDA when present."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def corpus():
    """Training bytes for the small GPTs of the compress tests (1 MiB of stdlib source)."""
    from effmem import demo_model
    return demo_model.split_corpus(demo_model.stdlib_corpus(max_bytes=1 << 20))[0]
