"""8-bit Adam moments (state_bits=8): the state's layout, and conversions to and from float32 moments.

The format is csrc/common/adam8_math.h's: per parameter, ``exp_avg`` and ``exp_avg_sq`` are uint8 codes
laid out as the parameter, and ``exp_avg_scale`` / ``exp_avg_sq_scale`` float32 block scales, one per 256
elements in the parameter's memory order (max |m| and max sqrt(v) of the block); a checkpoint holds them
by rows (rows_out), which any split of the rows takes apart again (rows_in). The kernels update them in
place; the functions here are the same formulas in torch ops, for checkpoints (a float32-moment checkpoint
loads into an 8-bit optimizer and back) and for the tests' reference.
"""
import struct
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

BLOCK = 256
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
_M64 = (1 << 64) - 1
_INV_M = torch.tensor(1.0, dtype=torch.float32) / 127
_INV_V = torch.tensor(1.0, dtype=torch.float32) / 255


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def scales_for_checkpoint(scales: Tensor, p: Tensor) -> Tensor:
    """A parameter's block scales as a checkpoint holds them: by rows (rows_out) where the parameter (under
    FSDP2 this rank's shard) lies dense in row-major order and FSDP2 shards it along its rows only (Shard(0),
    HSDP's too), which any split of the rows takes apart again: such a checkpoint loads on another mesh or
    without FSDP2, and one made without FSDP2 loads under it (through torch.distributed.checkpoint too; a
    shard whose blocks moved gets its moments decoded, as a float32 checkpoint's: _validate.entry). Under
    FSDP2 they go out as a DTensor of the parameter's rows: a plain tensor there is taken for replicated by
    torch.distributed.checkpoint, which then saved rank 0's scales for every rank. Otherwise (a
    channels_last parameter, tensor parallelism's strided shards) as the kernels keep them, under FSDP2 each
    rank's padded with zeros to a block count every rank computes alike and no shard exceeds (a DTensor
    tied to the mesh it was saved on)."""
    from effmem.optim._offload_distributed import shard_dims
    from effmem.optim._validate import is_dtensor, local_tensor
    if _by_rows(p):
        rows = rows_out(scales, local_tensor(p).shape[0], int(p.shape[1:].numel()))
        if not is_dtensor(p):
            return rows
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(rows, p.device_mesh, p.placements, run_check=False,
                                  shape=torch.Size([p.shape[0], rows.shape[1]]), stride=(rows.shape[1], 1))
    if not is_dtensor(p):
        return scales
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh, shape, sharded = p.device_mesh, list(p.shape), shard_dims(p)
    for d in sharded:
        placement = p.placements[d]
        # a shard's length along its dimension: at most torch.chunk's first chunk; a strided shard (FSDP2
        # over tensor parallelism) holds split_factor pieces of a finer chunking, up to split_factor - 1 more
        shape[placement.dim] = -(-shape[placement.dim] // mesh.size(d)) + getattr(placement, "split_factor", 1) - 1
    width = blocks(int(torch.Size(shape).numel()))
    padded = scales.new_zeros(width)
    padded[:scales.numel()] = scales
    ranks = int(torch.Size([mesh.size(d) for d in sharded]).numel())
    return DTensor.from_local(padded, mesh, [Shard(0) if d in sharded else Replicate() for d in range(mesh.ndim)],
                              run_check=False, shape=torch.Size([width * ranks]), stride=(1,))


# Rows of fewer than BLOCK elements cost up to 3 scales a row by rows (a 1-D parameter: 8 bytes per element
# and moment, more than its float32 moment): by rows only up to this many such rows (norms, biases).
SHORT_ROWS = 1 << 16


def _by_rows(p: Tensor) -> bool:
    """Whether p's block scales go into checkpoints by rows (scales_for_checkpoint): decided by p's whole
    shape, as every rank and mesh decides it alike."""
    from effmem.optim._validate import is_dtensor, local_tensor
    if p.dim() == 0 or (p.shape[1:].numel() < BLOCK and p.shape[0] > SHORT_ROWS):
        return False
    if not is_dtensor(p):
        return p.is_contiguous()
    from torch.distributed.tensor import Replicate, Shard
    return local_tensor(p).is_contiguous() and all(
        type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0) for pl in p.placements)


def row_width(row: int) -> int:
    """The scales a row of `row` elements keeps in rows_out: the most blocks such a row overlaps, wherever
    it starts in its block (rows of a multiple of BLOCK start at a block's start)."""
    return row // BLOCK if row % BLOCK == 0 else (row + 2 * BLOCK - 2) // BLOCK


def rows_out(scales: Tensor, rows: int, row: int) -> Tensor:
    """The block scales of a dense tensor of `rows` rows of `row` elements, by rows: float32 [rows, 1 +
    row_width(row)], each row's offset in its first block (an integer below BLOCK), then the scales of the
    blocks it overlaps (zeros after its last). The rows of shards of a tensor concatenate into the rows of
    the whole, which any other split of the rows can take apart again (rows_in)."""
    width = row_width(row)
    start = torch.arange(rows, dtype=torch.int64, device=scales.device) * row
    index = (start // BLOCK)[:, None] + torch.arange(width, dtype=torch.int64, device=scales.device)
    overlaps = index <= ((start + row - 1) // BLOCK)[:, None]
    values = scales.float()[index.clamp(max=scales.numel() - 1)] if scales.numel() else index.float()
    return torch.cat([(start % BLOCK).float()[:, None], torch.where(overlaps, values, 0.0)], dim=1)


def rows_in(saved: Tensor, row: int) -> Optional[Tensor]:
    """rows_out's scales (checked by the caller: float, [rows, 1 + row_width(row)], offsets integers that a
    row of `row` elements can start at) as the block scales of a dense tensor of those rows, where its rows
    start in their blocks where the saved ones did (the same shards, or the first of a tensor); else None:
    the blocks moved."""
    start = torch.arange(saved.shape[0], dtype=torch.int64, device=saved.device) * row
    if not torch.equal(saved[:, 0].long(), start % BLOCK):
        return None
    block = torch.arange(blocks(saved.shape[0] * row), dtype=torch.int64, device=saved.device)
    r = block * BLOCK // max(row, 1)   # the row a block starts in, and the block's place among its scales
    return saved[r, 1 + block - start[r] // BLOCK]


def offsets_problem(at: Tensor, row: int) -> Optional[str]:
    """What is wrong with rows_out's offsets `at` (one per row), or None. Each row after the first starts where the
    one before it ended, or at 0 (the first row of a shard: the rows of shards concatenate; the first row of this
    rank's may start anywhere, where it did in the whole): an offset in range but neither decoded its row with
    other blocks' scales, silently."""
    whole = (at >= 0) & (at < BLOCK) & (at == at.floor())
    a = torch.where(whole, at, torch.zeros_like(at)).long()   # in integers: float32 rounds (at + row) past 2^24
    fits = a + row <= max(row_width(row), 1) * BLOCK          # a row of a multiple of BLOCK starts at 0
    follows = torch.cat([torch.ones_like(a[:1], dtype=torch.bool), (a[1:] == (a[:-1] + row) % BLOCK) | (a[1:] == 0)])
    ok = whole & fits & follows
    if bool(ok.all()):
        return None
    i = int((~ok).nonzero()[0, 0])
    return f"row {i} starting at {float(at[i])!r}" + (f" after row {i - 1} at {float(at[i - 1])!r}" if i else "")


def rows_per_element(saved: Tensor, row: int) -> Tensor:
    """rows_out's scales (checked as for rows_in) as the scale of each element, in row-major order: for the
    moments of rows whose blocks moved, decoded element by element."""
    column = (saved[:, :1].long() + torch.arange(row, dtype=torch.int64, device=saved.device)) // BLOCK
    return saved[:, 1:].gather(1, column).reshape(-1)


# 8-bit moments go under names of their own, not torch's: a loader that knows float moments only (torch's
# AdamW; a float32 template of torch.distributed.checkpoint, which casts into it) took the codes 0..255 for
# the moments without a word. Under these it finds no 'exp_avg' and says so. opt.state holds them under the
# same names as the checkpoint: torch.distributed.checkpoint's flattened load (flatten_optimizer_state_dict,
# torchtitan's) rebuilds each entry from opt.state's names and dropped codes saved under other ones.
CODE_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}


# The names of the first and second moments in opt.state, by state_bits: torch's for float32 ones, CODE_KEYS'.
MOMENT_KEYS = {32: tuple(CODE_KEYS), 8: tuple(CODE_KEYS.values())}


def checkpoint_out(sd: Dict, params) -> Dict:
    """An optimizer's state_dict() with its 8-bit codes under CODE_KEYS and its block scales as
    scales_for_checkpoint makes them (params: the optimizer's parameters, in state_dict's numbering). Each
    8-bit entry a new dict: torch's state_dict() hands out opt.state's own."""
    for i, s in sd["state"].items():
        if is_8bit(s):
            s = {CODE_KEYS.get(k, k): v for k, v in s.items()}
            s.update({k: scales_for_checkpoint(s[k], params[i]) for k in SCALE_KEYS.values()})
            sd["state"][i] = s
    return sd


def checkpoint_in(saved: Dict, where: str) -> Dict:
    """A checkpoint entry with torch's names for its codes, as opt.state holds them (a copy: the caller's
    stays as it is). Checkpoints from before CODE_KEYS, codes under torch's names, load as they are."""
    if not any(k in saved for k in CODE_KEYS.values()):
        return dict(saved)
    torch_names = [k for k in CODE_KEYS if k in saved]
    if torch_names:
        raise ValueError(f"{where}: holds {torch_names[0]!r} next to 8-bit codes "
                         f"({', '.join(repr(c) for c in CODE_KEYS.values() if c in saved)}); expected float "
                         "moments or 8-bit codes with their block scales, not both")
    names = {c: k for k, c in CODE_KEYS.items()}
    return {names.get(k, k): v for k, v in saved.items()}


def local_scales(t, numel: int):
    """A checkpoint's block scales for a shard of `numel` elements: scales_for_checkpoint's DTensor as this
    rank's part without its padding; anything else as it is (checked by the caller)."""
    from effmem.optim._validate import is_dtensor
    if not is_dtensor(t):
        return t
    local = t.to_local()
    return local[:blocks(numel)] if local.dim() == 1 and local.numel() >= blocks(numel) else local


def is_8bit(state: Dict) -> bool:
    return "exp_avg_scale" in state


def seed(step: float, salt: int, second: bool) -> int:
    """adam8_seed: the rounding stream of a tensor (salt: its place in the optimizer) at a step count, taken
    as float32 (the kernels' step tensors; 2^24 + 1 is 2^24 there)."""
    step = struct.unpack("f", struct.pack("f", step))[0]
    s = ((int(step) << 32) ^ (salt * 0x9E3779B97F4A7C15)) & _M64
    return s ^ 0xD1B54A32D192ED03 if second else s


def memory_order(t: Tensor) -> Tensor:
    """The elements of a dense tensor in the order they lie in memory, as a flat tensor (a view when
    possible): the kernels' blocks run along memory."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).reshape(-1)


def from_memory_order(flat: Tensor, like: Tensor) -> Tensor:
    """A tensor of like's shape and strides holding `flat` in memory order."""
    out = torch.empty_like(like, dtype=flat.dtype)
    memory_order(out).copy_(flat)  # a view of out, for a dense like
    return out


def decode(codes: Tensor, scales: Tensor, second: bool, per_element: bool = False) -> Tensor:
    """Flat uint8 codes and their block scales (or, per_element, each code's scale) -> float32 moments (m,
    or v when `second`)."""
    k = codes.long()
    s = scales if per_element else scales.repeat_interleave(BLOCK)[:codes.numel()]
    if not second:
        f = (k & 0x7F).float() * _INV_M
        m = s * (f * f)
        return torch.where((k & 0x80) != 0, -m, m)
    f = k.float() * _INV_V
    r = s * (f * f)
    return r * r


def kept_m(m: Tensor, r: Tensor) -> Tensor:
    """The first moment the encoder keeps: 0 where r = sqrt(v) overflowed (adam8_math.h's adam8_kept_m)."""
    return torch.where(r > torch.finfo(torch.float32).max, torch.zeros_like(m), m)


def encode(x: Tensor, rounding_seed: int, second: bool) -> Tuple[Tensor, Tensor]:
    """Flat float32 moments (m, or r = sqrt(v) when `second`) -> (uint8 codes, block scales)."""
    from effmem.reference import hash_byte
    n = x.numel()
    a = x if second else x.abs()
    # the finite values' maximum: an infinite or NaN moment saturates its own code (adam8_math.h's adam8_finite)
    finite = torch.where(a <= torch.finfo(torch.float32).max, a, torch.zeros_like(a))
    # + 0.0: a block of -0.0 moments (a checkpoint's) has the scale +0.0, as the kernels' maximum from +0 gives
    scales = torch.nn.functional.pad(finite, (0, (-n) % BLOCK)).view(-1, BLOCK).amax(dim=1) + 0.0
    inv = torch.where(scales >= 2.0 ** -126, torch.tensor(1.0) / scales, torch.zeros_like(scales))
    inv = inv.repeat_interleave(BLOCK)[:n]
    kmax = 255.0 if second else 127.0
    t = (a * inv).double().sqrt().float() * kmax  # correctly rounded (torch's float32 sqrt is not always)
    u = (2 * hash_byte(rounding_seed, torch.arange(n, dtype=torch.int64, device=x.device)) + 1).float() / 512.0
    tu = t + u
    k = torch.floor(torch.where(tu < kmax, tu, torch.full_like(tu, kmax))).long()   # a NaN takes kmax (adam8_k)
    if second:
        k = torch.where((k == 0) & (a > 0) & (inv > 0), 1, k)
    else:
        k = k | torch.where(x < 0, 0x80, 0)
    return k.to(torch.uint8), scales


def _order(t: Tensor) -> Tuple[int, ...]:
    """The order of t's dimensions in memory, outermost first (size-1 dimensions, which do not move, left out)."""
    return tuple(d for d in sorted(range(t.dim()), key=lambda d: -t.stride(d)) if t.shape[d] != 1)


def _laid_like(t: Tensor, like: Tensor) -> Tensor:
    """t's values (logically) in a float32 tensor with like's shape, strides and device."""
    return torch.empty_like(like, dtype=torch.float32).copy_(t)


def to_float(state: Dict[str, Tensor], like: Tensor) -> Dict[str, Tensor]:
    """An 8-bit state as float32 moments shaped (and strided) like the parameter `like`. The blocks run along
    the saved codes' memory, which may differ from like's (a channels_last parameter saved, a contiguous one
    loading). state: a checkpoint's entry or opt.state's, under either name of the codes."""
    out = decoded(checkpoint_in(state, "state"), {})
    return dict(out, **{key: _laid_like(out[key], like) for key in SCALE_KEYS})


def decoded(state: Dict[str, Tensor], by_rows: Dict[str, Optional[Tensor]]) -> Dict[str, Tensor]:
    """An 8-bit state (codes under torch's names) as float32 moments laid out as its codes. by_rows: a
    moment's scales by rows (rows_out's, checked), where its block scales are not along the codes' memory;
    else (absent or None) its block scales are."""
    out = {k: v for k, v in state.items() if k not in SCALE_KEYS.values()}
    for key, scale in SCALE_KEYS.items():
        codes, second, rows = state[key], key == "exp_avg_sq", by_rows.get(key)
        if rows is None:
            out[key] = from_memory_order(_decode(memory_order(codes), state[scale].float(), second), codes)
        else:
            out[key] = _decode_rows(codes, rows.to(codes.device), second)
    return out


def _decode(codes: Tensor, scales: Tensor, second: bool) -> Tensor:
    """decode, by the CPU kernel (effmem::adam8_decode) where the tensors are on the CPU."""
    if codes.device.type == "cpu" and scales.device.type == "cpu":
        return torch.ops.effmem.adam8_decode(codes.contiguous(), scales.contiguous(), second)
    return decode(codes, scales, second)


def _decode_rows(codes: Tensor, rows: Tensor, second: bool) -> Tensor:
    """Codes with rows_out's scales as float32 moments in row-major order, shaped as the codes, about a
    million elements at a time: each element's scale is looked up, which takes about 40 bytes of it at once."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    flat, row = codes.reshape(-1), int(codes.shape[1:].numel())
    step = max(1, (1 << 20) // max(row, 1))
    for r0 in range(0, rows.shape[0], step):
        part = rows[r0:r0 + step]
        span = slice(r0 * row, (r0 + part.shape[0]) * row)
        out.view(-1)[span] = decode(flat[span], rows_per_element(part, row), second, per_element=True)
    return out


def to_8bit(state: Dict[str, Tensor], like: Tensor, step: float, salt: int) -> Dict[str, Tensor]:
    """Float moments as an 8-bit state (the encoding of a step, stochastically rounded as the kernels do),
    its blocks along like's memory. On the CPU by the kernel (effmem::adam8_encode): encode in torch ops
    takes about 1.3M elements a second there."""
    out = dict(state)
    m = memory_order(_laid_like(state["exp_avg"], like))
    v = memory_order(_laid_like(state["exp_avg_sq"], like))
    if m.device.type == "cpu":
        m_codes, v_codes, m_scales, v_scales = torch.ops.effmem.adam8_encode(m.contiguous(), v.contiguous(),
                                                                             float(step), salt)
        encoded = {"exp_avg": (m_codes, m_scales), "exp_avg_sq": (v_codes, v_scales)}
    else:
        r = v.double().sqrt().float()
        encoded = {"exp_avg": encode(kept_m(m, r), seed(step, salt, False), False),
                   "exp_avg_sq": encode(r, seed(step, salt, True), True)}
    for key, (codes, scales) in encoded.items():
        out[key] = from_memory_order(codes, like)
        out[SCALE_KEYS[key]] = scales
    return out


def convert(state: Dict[str, Tensor], like: Tensor, state_bits: int, step: float, salt: int) -> Dict[str, Tensor]:
    """A checkpoint's moments in the format of an optimizer with `state_bits`, for the parameter `like`: 8-bit
    ones decoded for a float32 optimizer, float32 ones encoded for an 8-bit optimizer; 8-bit ones as saved
    (bit for bit) unless like lies in memory in another order than the saved codes, whose blocks are then
    re-encoded along like's memory."""
    if is_8bit(state):
        if state_bits == 32:
            return to_float(state, like)
        if _order(state["exp_avg"]) != _order(like):
            return to_8bit(to_float(state, like), like, step, salt)
        return state
    return to_8bit(state, like, step, salt) if state_bits == 8 else state
