"""The quantize / dequantize CUDA kernels stay cheap per element, checked without a GPU.

bench/sass_count.py compiles csrc/cuda/quantize.cu for sm_90 with the rare
branches compiled away and counts the instructions on each kernel's longest
path. A kernel moving about 3 bytes per element is bandwidth-bound on an H100
only well under ~20 instructions per element; before the rewrite (one warp per
group, a hash per element) quantize took about 105 and dequantize about 50.
The bounds below sit just above what the rewrite measures (15.6 and 6.8 for
bf16, 8-bit), so a change that adds work per element shows up here.
"""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("sass_count", os.path.join(ROOT, "bench", "sass_count.py"))
sass_count = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_count)

pytestmark = pytest.mark.skipif(sass_count.find_nvcc() is None or sass_count.find_cuobjdump() is None,
                                reason="needs nvcc and cuobjdump (a CUDA toolkit and torch's triton wheel)")

# instructions per element on the 16-byte (aligned, whole-chunk) paths. Dequantize's flat kernel (whole
# groups, work split by stores) writes float32 in slices of 4 values, twice the windows of bf16's 8, each with
# its own stats and bounds: 8.3 for 5 bytes per value, against 7.2 for bf16's 3; its bound is its own.
BOUNDS = {"quantize": 17.5, "dequantize": 7.5}
FLAT_FP32_BOUND = 8.5
# 4-bit quantize with 64 values a thread (12.8 for bf16, 13.4 for float32 when added): what it was made for,
# the work done once per thread spread over twice the values, shows here.
WIDE_BOUND = 14.0


@pytest.fixture(scope="module")
def rows():
    return sass_count.measure("sm_90")


def test_every_kernel_is_counted(rows):
    kinds = {(r["kernel"], r["dtype"], r["bits"], r["vector"], r["path"], r["per_thread"]) for r in rows}
    # quantize and dequantize x 3 dtypes x 2 widths x (scalar, 16-byte), dequantize's flat kernel, and 4-bit
    # quantize's 16-byte path at 64 values a thread
    assert len(kinds) == 33 == len(rows)
    assert sum(r["path"] == "flat" for r in rows) == 6
    assert {(r["kernel"], r["bits"], r["vector"]) for r in rows if r["per_thread"] == 64} == {("quantize", 4, True)}


@pytest.mark.parametrize("kernel", ["quantize", "dequantize"])
def test_vector_path_instructions_per_element(rows, kernel):
    got = {(r["dtype"], r["bits"], r["path"], r["per_thread"]): r["per_element"] for r in rows
           if r["kernel"] == kernel and r["vector"]}
    assert len(got) == (12 if kernel == "dequantize" else 9)
    for (dtype, bits, path, per_thread), n in got.items():
        bound = FLAT_FP32_BOUND if (path, dtype) == ("flat", "fp32") else BOUNDS[kernel]
        bound = WIDE_BOUND if per_thread == 64 else bound
        assert n <= bound, f"{kernel} {dtype} {bits}-bit {path} x{per_thread}: {n} > {bound} ({got})"
    assert min(got.values()) > 3, "a count this low means the kernel's body was not found"


def test_longest_path_counts_one_branch_of_an_if():
    listing = """
        /*0000*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;
        /*0010*/               @P0 BRA 0x40 ;
        /*0020*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0030*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0040*/                   IADD3 R2, R1, 0x1, RZ ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA 0x60;
    """.splitlines()
    instrs = sass_count._parse(listing)
    assert sass_count.longest_path(instrs) == 6  # ISETP, BRA, 2 x IADD3, IADD3, EXIT
    loop = sass_count._parse(["        /*0000*/  IADD3 R1, R1, 0x1, RZ ;", "        /*0010*/  @P0 BRA 0x0 ;",
                              "        /*0020*/  EXIT ;"])
    with pytest.raises(ValueError, match="loop"):
        sass_count.longest_path(loop)
