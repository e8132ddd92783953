"""More cases of the two-process tests (tests/test_offload_distributed.py), run by distributed_worker.py:
loads on FSDP2 shards ("fsdp2_load"), 8-bit state through DCP onto another mesh ("dcp_reshard"), the fused loss
with an FSDP2 lm_head ("fsdp2_fused_ce"),
ZeroRedundancyOptimizer over OffloadAdam ("zero_offload"), OffloadAdam built before the ranks ("ddp_late"),
delay=True with attach_ddp ("ddp_delay"), async_step with a branch one rank skips ("ddp_unused_async") and
"fast" with norms that are FSDP2 units of their own ("fsdp2_norm_units")."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from distributed_worker import LR, _fsdp2_gpt, batch, same_on_all_ranks, tiny_gpt
from effmem import FusedAdam, OffloadAdam


def run_fsdp2_load(rank):
    """Loads under FSDP2 on shards of one row, or none (Linear(16, 3) over two ranks: 2 and 1 rows; a (1, 1, 16)
    token: 1 and 0), and across moment formats: FusedAdam compared the whole shapes and converted the DTensors,
    which failed on one rank only (the ranks then out of step) or in both directions across formats; a checkpoint
    of whole tensors was refused by a DTensor error after its param groups had been loaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 3), nn.Linear(3, 16))
        m.register_parameter("token", nn.Parameter(torch.randn(1, 1, 16)))
        fully_shard(m, mesh=init_device_mesh("cpu", (2,)))
        return m

    makers = {(cls.__name__, bits): (lambda ps, cls=cls, bits=bits: cls(ps, lr=LR, state_bits=bits))
              for cls in (FusedAdam, OffloadAdam) for bits in (32, 8)}
    for (name, bits), make in makers.items():
        m = build()
        opt = make(m.parameters())
        for step in range(2):
            (m(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))) + m.token).sum().backward()
            opt.step()
            opt.zero_grad()
        sd = copy.deepcopy(opt.state_dict())   # OffloadAdam's are its host memory, released by close()
        if isinstance(opt, OffloadAdam):
            opt.close()   # one OffloadAdam per parameter at a time
        for (other, other_bits), make_other in makers.items():
            into = make_other(m.parameters())
            into.load_state_dict(sd)
            got = into.state_dict()["state"]
            for k, state in sd["state"].items():   # the same format: bit for bit; the other: the same values
                for key in ("exp_avg_codes", "exp_avg_sq_codes") if bits == 8 else ("exp_avg", "exp_avg_sq"):
                    if bits == other_bits:
                        assert torch.equal(got[k][key].to_local(), state[key].to_local()), (name, other, k, key)
            if isinstance(into, OffloadAdam):
                into.close()
        whole = {"state": {k: {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in st.items()}
                           for k, st in sd["state"].items()},
                 "param_groups": [dict(g, lr=0.5) for g in sd["param_groups"]]}
        into = make(m.parameters())
        try:
            into.load_state_dict(whole)
            raise AssertionError("a checkpoint of whole tensors loaded into shards")
        except ValueError as err:
            assert "this rank's shard" in str(err) or "block scales" in str(err), err
        assert into.param_groups[0]["lr"] == LR and not into.state_dict()["state"], name   # nothing changed
        if isinstance(into, OffloadAdam):
            into.close()


def run_dcp_reshard(rank):
    """8-bit state saved by torch.distributed.checkpoint on one mesh loads on another: FSDP2 over both ranks
    (each holds about half the rows) to HSDP over a (2, 1) mesh (each holds every row), to the model without
    FSDP2, and back. Each moment loads as the moments the saving ranks held, decoded and encoded anew at the
    saved step, as a float32 checkpoint loads; where a parameter's blocks did not move (rows of a multiple of
    256, or one rank's shard that starts the tensor) its codes and scales load as saved. Before, each rank's
    block scales went out padded, tied to the mesh, and an unsharded model's as they were: torch's loader
    refused the other's shapes. seq_len 17: uneven shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor, distribute_tensor
    from effmem.optim import _adam8

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def whole(t, p):   # a state tensor of this rank's part of p, gathered whole
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor() \
            if isinstance(p, DTensor) else t

    def part(t, p):   # this rank's part of a whole tensor, as p's
        return distribute_tensor(t, p.device_mesh, p.placements).to_local() if isinstance(p, DTensor) else t

    def train(model, opt, steps, sharded):   # unsharded, both ranks take rank 0's batches: the same replicas
        for step in steps:
            model(*batch(rank if sharded else 0, step))[1].backward()
            opt.step()
            opt.zero_grad()

    where = os.path.join(os.path.dirname(sys.argv[4]), "dcp_reshard")
    kept = moved = 0
    for k, (cls, saved_on, loaded_on) in enumerate([(c, a, b) for c in (FusedAdam, OffloadAdam)
                                                    for a, b in (((2,), (2, 1)), ((2, 1), (2,)), ((2,), ()),
                                                                 ((), (2,)))]):
        model = _fsdp2_gpt(torch.bfloat16, seq_len=17, mesh_shape=saved_on)
        opt = cls(model.parameters(), lr=LR, state_bits=8)
        train(model, opt, range(2), bool(saved_on))
        path = os.path.join(where, str(k))
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        expected = [{n: whole(f[n], p) for n in ("exp_avg", "exp_avg_sq")} for p in model.parameters()
                    for f in [_adam8.to_float({n: local(v) for n, v in opt.state[p].items()}, local(p))]]
        fresh = _fsdp2_gpt(torch.bfloat16, seed=1, seq_len=17, mesh_shape=loaded_on)
        fresh_opt = cls(fresh.parameters(), lr=LR, state_bits=8)
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(fresh, sd["model"])
        set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
        for i, (p, q, want) in enumerate(zip(model.parameters(), fresh.parameters(), expected)):
            assert torch.equal(whole(local(p), p), whole(local(q), q)), (k, i)
            got = {n: local(v) for n, v in fresh_opt.state[q].items()}
            mine = {n: part(w, q) for n, w in want.items()}
            decoded = _adam8.to_float(got, local(q))
            if all(torch.equal(decoded[n], mine[n]) for n in mine):
                kept += 1   # the blocks did not move: as saved
                continue
            moved += 1
            anew = _adam8.to_8bit(mine, local(q), 2, i)   # at the saved step, with q's salt (its place)
            for n, v in anew.items():
                assert torch.equal(got[_adam8.CODE_KEYS.get(n, n)], v), (k, i, n)
        train(fresh, fresh_opt, [2], bool(loaded_on))   # and it trains on
        for o in (opt, fresh_opt):
            if isinstance(o, OffloadAdam):
                o.close()
    counts = torch.tensor([kept, moved])
    dist.all_reduce(counts)
    assert counts.min() > 0, counts   # both kinds of parameter met


def run_fsdp2_fused_ce(rank):
    """fuse_linear_cross_entropy with lm_head an FSDP2 unit of its own: resharded after its forward, the loss
    got its DTensor weight ("mixed torch.Tensor and DTensor"); refused by name. Not resharded, it trains."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    import effmem

    mesh = init_device_mesh("cpu", (2,))
    for reshard in (True, False):
        torch.manual_seed(0)
        model = effmem.fuse_linear_cross_entropy(LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=64)))
        fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        try:
            model(input_ids=x, labels=x).loss.backward()
            assert not reshard, "the sharded weight was taken"
            assert model.lm_head.weight.grad is not None
        except RuntimeError as err:
            assert reshard and "FSDP2 unit of its own" in str(err), err


def run_zero_offload(rank):
    """ZeroRedundancyOptimizer(optimizer_class=OffloadAdam) resumed: its load_state_dict assigns the inner
    optimizer's opt.state entries, which OffloadAdam refused at the next step; now loaded, and the resumed run
    is the uninterrupted one bit for bit."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make(model):
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=OffloadAdam, lr=LR)

    base = tiny_gpt(torch.float32)
    whole, resumed = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    opt, first = make(whole), make(resumed)
    for step in range(4):
        for model, o in ((whole, opt), (resumed, first)) if step < 2 else ((whole, opt),):
            model(*batch(rank, step))[1].backward()
            o.step()
            o.zero_grad()
        if step == 1:
            first.consolidate_state_dict(to=0)
            saved = [first.state_dict() if rank == 0 else None]
            dist.broadcast_object_list(saved, src=0)
            first.optim.close()
            second = make(resumed)
            second.load_state_dict(saved[0])
    for step in (2, 3):
        resumed(*batch(rank, step))[1].backward()
        second.step()
        second.zero_grad()
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    opt.optim.close()
    second.optim.close()


def run_ddp_late(rank, init):
    """OffloadAdam built before init_process_group, then DDP: it streamed gradients off in backward (one process
    at construction), before DDP's all-reduce, and the replicas drifted apart without a word. It now takes them
    at step() from the first backward with several ranks, and says so."""
    import warnings
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = tiny_gpt(torch.float32)
    model = copy.deepcopy(base)
    off = OffloadAdam(model.parameters(), lr=LR)
    assert off._hooks   # one process so far: it streams
    init()
    ddp, ref = DDP(model), DDP(copy.deepcopy(base))
    fused = FusedAdam(ref.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            for m, opt in ((ddp, off), (ref, fused)):
                m(*batch(rank, step))[1].backward()
                opt.step()
                opt.zero_grad()
    assert sum("built before torch.distributed.init_process_group" in str(w.message) for w in seen) == 1
    assert not off._hooks
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert same_on_all_ranks(p.detach()), name
        assert torch.allclose(p, q, rtol=1e-6, atol=0), name
    off.close()


def run_ddp_delay(rank):
    """delay=True with attach_ddp: step() returns before the engine's copies have read DDP's buckets, and the
    forward's pre-hook waited for them only while gradients it had streamed were pending, which step() clears:
    the next backward overwrote buckets still being read (a reviewer's run, with the copies slowed as here:
    weights 13-38% of a step off, the ranks apart). It waits at every forward now: as plain DDP, bit for bit."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(attach: bool):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)))
        opt = OffloadAdam(model.parameters(), lr=1e-2, delay=True, _host_delay_us=3000.0)   # slow copies
        if attach:
            opt.attach_ddp(model)
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        opt.close()
        return [p.detach() for p in model.parameters()]
    for p, q in zip(train(attach=False), train(attach=True)):
        assert same_on_all_ranks(q) and torch.equal(p, q), (p - q).abs().max()


def run_ddp_unused_async(rank):
    """async_step under DDP(find_unused_parameters=True), a branch run on rank 0 only: DDP averages rank 0's
    gradient into rank 1's branch, whose forward installed nothing there. The engine refused it as "never
    installed" (rank 1 raised, rank 0 lost its peer: a reviewer's run); its weights were not read, so it is
    installed and taken: both ranks train as FusedAdam does, bit for bit."""
    from test_offload_async import _Branch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = _Branch()
    ddp, ref = DDP(copy.deepcopy(base), find_unused_parameters=True), DDP(base, find_unused_parameters=True)
    off, fused = OffloadAdam(ddp.parameters(), lr=1e-2, async_step=True), FusedAdam(ref.parameters(), lr=1e-2)
    off.attach(ddp)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        for m, opt in ((ddp, off), (ref, fused)):
            nn.functional.mse_loss(m(x, use_c=rank == 0), y).backward()
            opt.step()
            opt.zero_grad()
    off.flush()
    for p, q in zip(ddp.parameters(), ref.parameters()):
        assert same_on_all_ranks(p.detach()) and torch.equal(p, q), (p - q).abs().max()
    off.close()


def run_fsdp2_norm_units(rank):
    """"fast" applied before fully_shard, with each layer's norms FSDP2 units of their own: a norm's gathered
    weight is freed after its forward and gathered again at its own backward, after the projections reading
    its output rebuilt it from that weight (SIGSEGV, a reviewer's run). Such a norm runs its own forward now:
    gradients within "fast"'s 8-bit rounding of plain FSDP2's (LayerNorm: the demo GPT; RMSNorm: a Llama)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from effmem.activations import apply_activation_policy
    from test_activations import llama

    mesh = init_device_mesh("cpu", (2,))
    for make, norms, loss in ((lambda: tiny_gpt(torch.float32), ("ln1", "ln2"), lambda m, x: m(*x)[1]),
                              (llama, ("input_layernorm", "post_attention_layernorm"),
                               lambda m, x: m(input_ids=x[0], labels=x[0]).loss)):
        grads = []
        for policy in (None, "fast"):
            model = make()
            if policy:
                apply_activation_policy(model, policy)
            blocks = model.blocks if hasattr(model, "blocks") else model.model.layers
            for block in blocks:
                for name in norms:
                    fully_shard(getattr(block, name), mesh=mesh)
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            loss(model, batch(rank, 0)).backward()
            grads.append(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
        assert same_on_all_ranks(grads[1])
        assert (grads[1] - grads[0]).norm() <= 0.05 * grads[0].norm(), (grads[1] - grads[0]).norm() / grads[0].norm()
    # a norm inside a unit nested in the layer (not the norm itself): its weight is freed before the rebuild,
    # which is refused by name (it crashed too)
    model = apply_activation_policy(tiny_gpt(torch.float32), "fast")
    for block in model.blocks:
        block.ln1 = nn.Sequential(block.ln1)
        fully_shard(block.ln1, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        model(*batch(rank, 0))[1].backward()
        raise AssertionError("the rebuild from a freed weight was not refused")
    except RuntimeError as e:
        assert "FSDP2 has freed" in str(e), e
