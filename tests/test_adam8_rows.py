"""8-bit block scales by rows (effmem.optim._adam8.rows_out / rows_in): how an FSDP2 parameter's 8-bit state goes
into a checkpoint, so that it loads on another split of the rows (another mesh, or none).

The blocks of 256 run along each shard's memory, so they move when the rows are split otherwise. Each row keeps
its offset in its first block and the scales of the blocks it overlaps; a load whose rows start in their blocks
where the saved ones did takes codes and scales as saved, any other decodes the moments (as a float32 checkpoint
loads). Here the shards are simulated on one process: slices of a tensor's rows, each quantised on its own as a
rank quantises its shard. tests/distributed_cases.py (run_dcp_reshard) does it through
torch.distributed.checkpoint with FSDP2 and HSDP meshes.
"""
import pytest
import torch

import effmem
from effmem import FusedAdam
from effmem.optim import _adam8, _validate

SHAPES = [(17, 33), (5, 512), (9,), (3, 300), (6, 257), (2, 3, 100), (1, 1), (4, 0)]


def splits(rows, n):
    """torch.chunk's split of `rows` rows into n shards (some empty), as FSDP2 shards dimension 0."""
    size = -(-rows // n)
    return [(min(rows, i * size), min(rows, (i + 1) * size)) for i in range(n)]


def saved_by(shards, m, v, step=3.0):
    """Each shard of the moments quantised on its own, its scales by rows, concatenated as a checkpoint of the
    whole holds them; and each shard's moments as the 8-bit state decodes them."""
    row = int(m.shape[1:].numel())
    parts, floats = [], []
    for a, b in shards:
        st = _adam8.to_8bit({"exp_avg": m[a:b], "exp_avg_sq": v[a:b]}, m[a:b], step, salt=5)
        parts.append({"exp_avg_codes": st["exp_avg"], "exp_avg_sq_codes": st["exp_avg_sq"],
                      "exp_avg_scale": _adam8.rows_out(st["exp_avg_scale"], b - a, row),
                      "exp_avg_sq_scale": _adam8.rows_out(st["exp_avg_sq_scale"], b - a, row),
                      "blocks": (st["exp_avg_scale"], st["exp_avg_sq_scale"])})
        floats.append(_adam8.to_float(st, m[a:b]))
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "blocks"}
    decoded = {k: torch.cat([f[k] for f in floats]) for k in ("exp_avg", "exp_avg_sq")}
    return whole, decoded, [p["blocks"] for p in parts]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("saved_on,loaded_on", [(1, 2), (2, 1), (2, 3), (3, 2), (2, 2), (3, 3)])
def test_scales_by_rows_load_on_any_split_of_the_rows(shape, saved_on, loaded_on):
    torch.manual_seed(0)
    m = torch.randn(shape) * torch.rand(shape) ** 4
    v = torch.rand(shape) ** 6
    whole, decoded, blocks = saved_by(splits(shape[0], saved_on), m, v)
    row = int(m.shape[1:].numel())
    for j, (a, b) in enumerate(splits(shape[0], loaded_on)):
        entry = {k: t[a:b] for k, t in whole.items()}
        entry["step"] = torch.tensor(3.0)
        out, step, _ = _validate.entry(entry, torch.empty(shape)[a:b], "state[0]")
        same_blocks = all((r - a) * row % 256 == (r - a0) * row % 256 for r in range(a, b)
                          for a0, b0 in splits(shape[0], saved_on) if a0 <= r < b0)
        assert ("exp_avg_scale" in out) == same_blocks, (a, b)
        if same_blocks and saved_on == loaded_on:   # the same shards: codes and scales as saved, bit for bit
            assert torch.equal(out["exp_avg_scale"], blocks[j][0]) and torch.equal(out["exp_avg_sq_scale"],
                                                                                   blocks[j][1])
            assert torch.equal(out["exp_avg"], whole["exp_avg_codes"][a:b])
        got = _adam8.to_float(out, m[a:b]) if same_blocks else out
        for k in ("exp_avg", "exp_avg_sq"):   # either way, the moments the saving shards held
            assert got[k].dtype == torch.float32 and torch.equal(got[k], decoded[k][a:b]), (k, a, b)


@pytest.mark.parametrize("bits", [32, 8])
def test_an_optimizer_loads_scales_by_rows_of_other_shards(bits):
    """Through load_state_dict: saved on 3 shards, loaded whole. A float32 optimizer holds the decoded moments
    bit for bit; an 8-bit one those moments encoded at the saved step, as a float32 checkpoint loads; both
    then step."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(17, 33))
    m, v = torch.randn(17, 33) * 1e-2, torch.rand(17, 33) * 1e-4
    whole, decoded, _ = saved_by(splits(17, 3), m, v)
    sd = {"state": {0: dict(whole, step=torch.tensor(3.0))}, "param_groups": [dict(FusedAdam([p]).param_groups[0],
                                                                                     params=[0])]}
    opt = FusedAdam([p], state_bits=bits)
    opt.load_state_dict(sd)
    state = opt.state[p]
    if bits == 32:
        assert torch.equal(state["exp_avg"], decoded["exp_avg"]) and torch.equal(state["exp_avg_sq"],
                                                                                 decoded["exp_avg_sq"])
    else:
        want = _adam8.to_8bit(dict(decoded), p, 3.0, salt=0)
        assert torch.equal(state["exp_avg_codes"], want["exp_avg"])
        assert torch.equal(state["exp_avg_sq_scale"], want["exp_avg_sq_scale"])
    p.grad = torch.ones_like(p)
    opt.step()
    assert float(opt.state[p]["step"]) == 4.0


@pytest.mark.parametrize("bad,why", [
    (lambda s: s[:, :1], "width"), (lambda s: s.long(), "dtype"),
    (lambda s: torch.cat([s[:, :1] + 0.5, s[:, 1:]], 1), "fractional offset"),
    (lambda s: torch.cat([s[:, :1] + 256, s[:, 1:]], 1), "offset past its block"),
    (lambda s: s[:3], "rows")])
def test_bad_scales_by_rows_name_themselves(bad, why):
    whole, _, _ = saved_by(splits(5, 2), torch.randn(5, 512), torch.rand(5, 512))
    entry = dict(whole, step=torch.tensor(3.0))
    entry["exp_avg_sq_scale"] = bad(entry["exp_avg_sq_scale"])
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg_sq_scale'\]: expected block scales by rows, float, "
                                         r"of shape \(5, 3\)"):
        _validate.entry(entry, torch.empty(5, 512), "state[0]")


@pytest.mark.parametrize("offset,named", [(5.0, r"row 1 starting at 5\.0 after row 0 at 0\.0"),
                                          (float("nan"), r"row 1 starting at nan")])
def test_an_offset_in_range_that_does_not_follow_the_row_before_is_refused_by_name(offset, named):
    """A row's offset in its first block is where the row before it ended, or 0 (the first row of a shard); one
    in range but neither (5) loaded silently and decoded the row with other blocks' scales (a reviewer's resume
    fuzz), and a NaN one was refused naming the tensor's dtype and shape, which were right."""
    whole, _, _ = saved_by(splits(5, 2), torch.randn(5, 300), torch.rand(5, 300))
    entry = dict(whole, step=torch.tensor(3.0))
    _validate.entry(dict(entry), torch.empty(5, 300), "state[0]")   # as saved (shards of 3 and 2 rows): loads
    entry["exp_avg_scale"] = entry["exp_avg_scale"].clone()
    entry["exp_avg_scale"][1, 0] = offset
    with pytest.raises(ValueError, match=r"\['exp_avg_scale'\]: expected block scales by rows.*, got " + named):
        _validate.entry(entry, torch.empty(5, 300), "state[0]")
    # rows of a multiple of 256 start at 0 (5 on every row follows itself: an out-of-range gather, not an error);
    # and in integers: float32 rounded (offset + row) past 2^24 elements a row and refused a real checkpoint
    assert _adam8.offsets_problem(torch.full((5,), 5.0), 512) == "row 0 starting at 5.0"
    for rows, row in ((2, 2 ** 24 + 1), (3, 2 ** 24 + 3), (2, 20_000_001)):
        assert _adam8.offsets_problem((torch.arange(rows) * row % 256).float(), row) is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("form", ["by_rows", "flat"])
def test_corrupt_scale_values_are_refused(value, form):
    """A NaN or inf block scale loaded silently and made the next step's weights NaN or inf; a negative
    exp_avg_scale turned the momentum around."""
    whole, _, _ = saved_by(splits(5, 2), torch.randn(5, 512), torch.rand(5, 512))
    entry = dict(whole, step=torch.tensor(3.0))
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        scales = entry[key].clone() if form == "by_rows" else _adam8.rows_in(entry[key], 512).clone()
        (scales[2, 1] if form == "by_rows" else scales[4]).fill_(value)
        bad = dict(entry, **{key: scales})
        with pytest.raises(ValueError, match=rf"state\[0\]\['{key}'\]: block scales are each block's largest "
                                             r"moment, finite and >= 0"):
            _validate.entry(bad, torch.empty(5, 512), "state[0]")


def moments(n, seed=0):
    """Float moments of every kind a block meets: spread over magnitudes, zeros, a block below FLT_MIN, and
    non-finite ones."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * torch.logspace(-6, 0, n) ** 2
    v = torch.rand(n, generator=g) * torch.logspace(-12, 0, n)
    if n > 600:
        m[10], v[11], m[12], v[300:556] = float("inf"), float("nan"), -0.0, 1e-40
        m[14], v[14] = -5.0, float("inf")   # an overflowed v: its m dropped (adam8_kept_m)
        m[513:600] = 0.0
    return m, v


@pytest.mark.parametrize("isa", effmem._C.supported_cpu_isas().split(","))
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 70000, 140001])
def test_the_cpu_conversions_match_the_reference_bit_for_bit(n, isa):
    """effmem::adam8_encode / adam8_decode (the CPU kernel, every vector unit, spans of 65536 on the pool)
    against _adam8's torch ops, which the step kernel is tested against: the same codes and scales, the same
    moments back. They convert checkpoints (to_8bit, to_float): the torch ops took 13 s for 16M elements."""
    m, v = moments(n)
    previous = effmem._C.cpu_isa()
    try:
        effmem._C.set_cpu_isa(isa)
        for step, salt in ((0.0, 0), (3.0, 7), (123457.0, 2 ** 40), (2.0 ** 24 + 1, 5)):   # (float32: 2^24)
            got = torch.ops.effmem.adam8_encode(m, v, step, salt)
            r = v.double().sqrt().float()
            want_m = _adam8.encode(_adam8.kept_m(m, r), _adam8.seed(step, salt, False), False)
            want_v = _adam8.encode(r, _adam8.seed(step, salt, True), True)
            for a, b in zip(got, (want_m[0], want_v[0], want_m[1], want_v[1])):
                assert a.dtype == b.dtype and torch.equal(a, b), (step, salt)
            for codes, scales, second in ((got[0], got[2], False), (got[1], got[3], True)):
                back = torch.ops.effmem.adam8_decode(codes, scales, second)
                ref = _adam8.decode(codes, scales, second)
                assert torch.equal(back.isnan(), ref.isnan()) and torch.equal(back.nan_to_num(), ref.nan_to_num())
    finally:
        effmem._C.set_cpu_isa(previous)


def test_a_block_of_negative_zero_moments_gets_the_same_scale_bits_from_the_kernel_and_the_reference():
    """_adam8.encode (the conversion of CUDA tensors) kept amax's -0.0 as the scale of a block whose moments are
    all -0.0 (a checkpoint's), where the kernels' maximum from +0 gives +0.0: torch.equal, which the test above
    uses, calls them equal, and a checkpoint converted on a GPU differed from the CPU's in a sign bit."""
    m, v = torch.full((512,), -0.0), torch.full((512,), -0.0)
    m[300], v[300] = 0.5, 1.0
    got = torch.ops.effmem.adam8_encode(m, v, 3.0, 7)
    r = v.double().sqrt().float()
    want_m = _adam8.encode(_adam8.kept_m(m, r), _adam8.seed(3.0, 7, False), False)
    want_v = _adam8.encode(r, _adam8.seed(3.0, 7, True), True)
    for a, b in ((got[2], want_m[1]), (got[3], want_v[1])):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (a, b)
    assert torch.equal(got[0], want_m[0]) and torch.equal(got[1], want_v[0])


def test_the_cpu_conversions_pass_opcheck_and_refuse_bad_tensors_by_name():
    m, v = moments(1000)
    torch.library.opcheck(torch.ops.effmem.adam8_encode.default, (m, v, 5.0, 3))
    codes, _, scales, _ = torch.ops.effmem.adam8_encode(m, v, 5.0, 3)
    torch.library.opcheck(torch.ops.effmem.adam8_decode.default, (codes, scales, False))
    for call, message in (
            (lambda: torch.ops.effmem.adam8_encode(m, v[:-1], 5.0, 3), r"v must be a contiguous 1-D Float CPU "
                                                                       r"tensor of 1000 elements, got"),
            (lambda: torch.ops.effmem.adam8_encode(m.double(), v, 5.0, 3), r"m must be a contiguous 1-D Float"),
            (lambda: torch.ops.effmem.adam8_encode(m, v, 2.5, 3), r"step must be a whole number in \[0, 2\^63\)"),
            (lambda: torch.ops.effmem.adam8_decode(codes, scales[:-1], False), r"scales must be a contiguous 1-D "
                                                                                 r"Float CPU tensor of 4 elements"),
            (lambda: torch.ops.effmem.adam8_decode(codes.view(10, 100).t().reshape(-1)[::2], scales, False),
             r"codes must be a contiguous 1-D Byte CPU tensor of 500 elements")):
        with pytest.raises(ValueError, match=message):
            call()


def test_long_parameters_of_short_rows_keep_flat_scales():
    """By rows, a row of fewer than 256 elements costs up to 3 scales: a flat 1-D parameter of 16M elements made
    a 288 MiB checkpoint, more than float32 moments. Past SHORT_ROWS such rows the scales stay flat (a
    checkpoint tied to its shards under FSDP2); norms and biases, and rows of 256 or more, go by rows."""
    shapes = {(300,): True, (_adam8.SHORT_ROWS,): True, (_adam8.SHORT_ROWS + 1,): False,
              (_adam8.SHORT_ROWS + 1, 8): False, (_adam8.SHORT_ROWS + 1, 256): True, (4, 3, 100): True}
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = FusedAdam(params, state_bits=8)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state_dict()["state"]
    for i, (shape, by_rows) in enumerate(shapes.items()):
        scales = state[i]["exp_avg_scale"]
        assert scales.dim() == (2 if by_rows else 1), shape
        assert scales.numel() <= 3 * shape[0] + _adam8.blocks(params[i].numel()), shape   # a row: <= 3 more
    again = FusedAdam(params, state_bits=8)
    again.load_state_dict(opt.state_dict())
    assert all(torch.equal(again.state[p]["exp_avg_scale"], opt.state[p]["exp_avg_scale"]) for p in params)
