"""One rank of the two-process OffloadAdam tests (tests/test_offload_distributed.py).

    python distributed_worker.py MODE RANK WORLD_SIZE STORE_FILE

MODE is "ddp", "fsdp2", "fsdp2_async" (OffloadAdam(async_step=True) under FSDP2), "plan" (effmem.plan's
sharded picks applied), "fsdp2_clip" (FusedAdam's and effmem's clips over sharded gradients), "dcp" (a resume
through torch.distributed.checkpoint), or one of tests/distributed_cases.py's. CPU tensors, gloo backend. Each
rank checks its own results and exits non-zero (with the assertion on stderr) on a mismatch.
"""
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from effmem import FusedAdam, OffloadAdam, demo_model

STEPS = 6
LR = 3e-3


def tiny_gpt(dtype, seq_len=16):
    torch.manual_seed(0)
    cfg = demo_model.GPTConfig(seq_len=seq_len, n_layer=2, d_model=32, n_head=2)
    return demo_model.ByteGPT(cfg).to(dtype)


def batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (4, 16), generator=gen)
    return x, (x * 7 + 3) % 256


def same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def run_ddp(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = tiny_gpt(torch.float32)
    a, b, c = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    fused = FusedAdam(a.parameters(), lr=LR, weight_decay=0.1)
    off = OffloadAdam(b.parameters(), lr=LR, weight_decay=0.1)   # stream_grads defaults to False here
    assert not off._hooks, "under DDP the hooks would take p.grad before the all-reduce"
    streaming = OffloadAdam(c.parameters(), lr=LR, weight_decay=0.1)
    streaming.attach_ddp(c)   # gradients handed over as each DDP bucket's all-reduce completes
    unused = DDP(copy.deepcopy(base), find_unused_parameters=True)
    try:
        OffloadAdam(unused.parameters(), lr=LR).attach_ddp(unused)
        raise AssertionError("attach_ddp accepted find_unused_parameters=True")
    except ValueError as err:
        assert "find_unused_parameters" in str(err)
    n = sum(p.numel() for p in c.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        for model, opt in ((a, fused), (b, off), (c, streaming)):
            _, loss = model(x, y)
            loss.backward()
            if opt is streaming:
                assert opt.counters()["bytes_down"] == (step + 1) * 4 * n   # already on the host
            norm = opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
            if opt is off:
                losses.append(loss.item())
                assert same_on_all_ranks(norm.reshape(1).float().cpu())
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        # Clipping: the norm from differently split partial sums may differ in the last bit.
        assert torch.allclose(pa, pb, rtol=1e-6, atol=0), name
        assert torch.allclose(pa, pc, rtol=1e-6, atol=0), name
        assert same_on_all_ranks(pb.detach()), name   # every rank holds the same replica
        assert same_on_all_ranks(pc.detach()), name
    assert losses[-1] < losses[0], losses
    # Gradient accumulation over two backward calls, each all-reduced (no no_sync()).
    for step in range(2):
        for model, opt in ((a, fused), (c, streaming)):
            for micro in range(2):
                x, y = batch(rank, 100 + 2 * step + micro)
                model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    # Not bit for bit: DDP without a hook all-reduces (r1 + local2) / world for the second
    # micro-batch, the streamed path adds r1 + mean(local2) on the host. Adam turns such
    # last-bit differences of tiny gradients into up to ~1e-6 absolute (measured 8.8e-7,
    # lr 3e-3): bound each parameter by 1% of one learning-rate step.
    for (name, pa), pc in zip(a.named_parameters(), c.parameters()):
        assert torch.allclose(pa, pc, rtol=1e-5, atol=0.01 * LR), (name, (pa - pc).abs().max().item())
    assert all(p.grad is None for p in c.parameters())
    off.close()
    streaming.close()


def run_fsdp2(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_gpt(torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    # The reference: FusedAdam on plain copies of this rank's shards, fed the same local gradients.
    shadow = [nn.Parameter(p.to_local().detach().clone()) for p in params]
    # A plain (replicated) parameter beside the shards: the global norm counts it once, not per rank.
    extra = nn.Parameter(torch.ones(10))
    extra_shadow = nn.Parameter(torch.ones(10))
    fused = FusedAdam(shadow + [extra_shadow], lr=LR, weight_decay=0.1)
    off = OffloadAdam(params + [extra], lr=LR, weight_decay=0.1)
    assert not off.state   # as torch's optimizers: entries once stepped (DCP makes them by a step at lr 0)
    local_numel = sum(p.to_local().numel() for p in params)
    full_numel = sum(p.numel() for p in params)
    assert local_numel < full_numel   # each rank holds (and offloads) only its shard
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        for s, p in zip(shadow, params):
            s.grad = p.grad.to_local().clone()
        extra.grad = torch.full((10,), 0.5 + step)
        extra_shadow.grad = extra.grad.clone()
        # The global norm: the shards' sums of squares all-reduced, plus the replicated one once.
        sq = torch.stack([s.grad.double().square().sum() for s in shadow]).sum()
        dist.all_reduce(sq)
        sq = sq + extra.grad.double().square().sum()
        norm = off.clip_grad_norm_(1e9)   # computed but, with this max_norm, not clipping
        assert torch.allclose(norm.double(), sq.sqrt(), rtol=1e-6), (norm, sq.sqrt())
        off.step()
        off.zero_grad()
        fused.step()
        fused.zero_grad()
        for i, (s, p) in enumerate(zip(shadow, params)):
            assert torch.equal(p.to_local(), s), i
        assert torch.equal(extra, extra_shadow)
        state = off.state[params[0]]["exp_avg"]
        assert isinstance(state, DTensor) and state.placements == params[0].placements   # sharded, for DCP
        assert state.to_local().data_ptr() == off._views[0][1].data_ptr()   # the engine's memory, not a copy
    counters = off.counters()
    assert counters["bytes_down"] == STEPS * 4 * (local_numel + 10), counters
    assert losses[-1] < losses[0], losses
    off.close()


def run_fsdp2_async(rank):
    """async_step under FSDP2: each unit's hook installs the shards' new weights before FSDP all-gathers
    them (also for a unit prefetched by another), so training is plain OffloadAdam's, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    runs = {}
    for mode in ("plain", "async"):
        model = tiny_gpt(torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # explicit prefetch: block 1's all-gather is issued at block 0's forward, before block 1's hooks
        model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
        off = OffloadAdam(model.parameters(), lr=LR, weight_decay=0.1, async_step=mode == "async")
        if mode == "async":
            off.attach(model)
        losses = []
        for step in range(STEPS):
            _, loss = model(*batch(rank, step))
            loss.backward()
            losses.append(loss.item())
            off.clip_grad_norm_(0.5)
            off.step()
            off.zero_grad()
        off.flush()
        runs[mode] = losses, [p.to_local().clone() for p in model.parameters()]
        off.close()
    assert runs["plain"][0] == runs["async"][0], runs
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"][1], runs["async"][1]))
    assert runs["plain"][0][-1] < runs["plain"][0][0]


def _fsdp2_gpt(dtype=torch.float32, seed=0, seq_len=16, mesh_shape=None):
    """tiny_gpt under FSDP2 on a mesh of mesh_shape (default: every rank; 2-D: HSDP; (): unsharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt(dtype, seq_len)
    if seed:
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
    shape = (dist.get_world_size(),) if mesh_shape is None else mesh_shape
    if not shape:   # (): the model unsharded
        return model
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])   # 2-D: HSDP
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_fsdp2_clip(rank):
    """FusedAdam.clip_grad_norm_ and effmem.clip_grad_norm_ over FSDP2's sharded gradients: the global norm
    on every rank (torch's clip to float32 rounding), and the clipped step that torch's clip gives. Before,
    both raised DTensor's "effmem.l2norm has no sharding strategy"."""
    import effmem
    from torch.distributed.tensor import DTensor

    models = [_fsdp2_gpt() for _ in range(3)]
    opts = [FusedAdam(m.parameters(), lr=LR) for m in models]
    for step in range(3):
        for m in models:
            m(*batch(rank, step))[1].backward()
        want = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.05)
        want = want.full_tensor() if isinstance(want, DTensor) else want
        got = [opts[1].clip_grad_norm_(0.05), effmem.clip_grad_norm_(models[2].parameters(), 0.05)]
        assert want > 0.05, want   # the clip acts
        for g in got:
            assert not isinstance(g, DTensor) and torch.allclose(g, want, rtol=1e-5), (g, want)
            assert same_on_all_ranks(g.reshape(1))
        for o in opts:
            o.step()
            o.zero_grad()
    for name, p in models[0].named_parameters():
        for other in models[1:]:
            q = dict(other.named_parameters())[name]
            assert torch.allclose(p.to_local(), q.to_local(), rtol=1e-5, atol=1e-6), name


def run_dcp(rank):
    """A resume through torch.distributed.checkpoint, as its docs show it (get_*_state_dict of a fresh model
    and optimizer, dcp.load into them, set_*_state_dict), under FSDP2: the resumed run equals the
    uninterrupted one bit for bit. Before, a fresh OffloadAdam's state_dict had no entries for DCP to load
    into, and the resumed run started from zero moments without a word; 8-bit block scales went out as plain
    tensors, which DCP takes for replicated (rank 0's were loaded on every rank). seq_len 17: the position
    table's 17 rows shard unevenly (9 and 8), so one rank has fewer scale blocks than the other."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    where = os.path.join(os.path.dirname(sys.argv[4]), "dcp")
    for k, make in enumerate((lambda ps: FusedAdam(ps, lr=LR), lambda ps: OffloadAdam(ps, lr=LR),
                              lambda ps: FusedAdam(ps, lr=LR, state_bits=8),
                              lambda ps: OffloadAdam(ps, lr=LR, state_bits=8))):
        model = _fsdp2_gpt(torch.bfloat16, seq_len=17)
        opt = make(model.parameters())
        for step in range(4):
            if step == 2:
                path = os.path.join(where, str(k))
                dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                         checkpoint_id=path)
            model(*batch(rank, step))[1].backward()
            opt.step()
            opt.zero_grad()
        fresh = _fsdp2_gpt(torch.bfloat16, seed=1, seq_len=17)   # other weights: the checkpoint must bring them
        fresh_opt = make(fresh.parameters())
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(fresh, sd["model"])
        set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
        for step in (2, 3):
            fresh(*batch(rank, step))[1].backward()
            fresh_opt.step()
            fresh_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), (k, name)
        for o in (opt, fresh_opt):
            if isinstance(o, OffloadAdam):
                o.close()


def run_plan(rank):
    """effmem.plan's sharded picks applied on two ranks train like one process on both ranks' batches."""
    import effmem
    from torch.distributed.tensor import DTensor

    base = tiny_gpt(torch.float32)
    plan = effmem.plan(base, batch=8, seq=16, accum=1, device="cpu", gpus=2)
    for sharding in ("ddp", "zero1", "zero2", "zero3"):
        name = next(c.name for c in plan.candidates if (c.config.sharding, c.config.precision, c.config.activations,
                                                         c.config.optimizer, c.config.state_bits)
                    == (sharding, "fp32", "none", "gpu", 32))
        model, opt = plan.apply(copy.deepcopy(base), name, lr=LR)
        ref = copy.deepcopy(base)
        ref_opt = FusedAdam(ref.parameters(), lr=LR)
        for step in range(3):
            _, loss = model(*batch(rank, step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            # The reference sees both ranks' batches: the mean of their mean losses, as DDP and FSDP average.
            total = sum(ref(*batch(r, step))[1] for r in range(2)) / 2
            total.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        inner = model.module if hasattr(model, "module") else model
        for (n, p), (_, q) in zip(inner.named_parameters(), ref.named_parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            # Summation order differs (gradients averaged across ranks): Adam turns last-bit differences of
            # near-zero gradients into up to ~1e-6 here; a wrong setup (a rank's gradient left out or
            # counted twice) moves weights by about the learning rate, 3e-3.
            assert torch.allclose(full, q, rtol=1e-5, atol=2e-5), (sharding, n, (full - q).abs().max())
        if sharding in ("zero2", "zero3"):
            assert all(isinstance(p, DTensor) for p in inner.parameters()), sharding


def main():
    mode, rank, world, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)

    def init():
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    import distributed_cases as more   # (imports this module: after its definitions)
    if mode == "ddp_late":
        more.run_ddp_late(rank, init)
    else:
        init()
    try:
        if mode != "ddp_late":
            {"ddp": run_ddp, "fsdp2": run_fsdp2, "fsdp2_async": run_fsdp2_async, "plan": run_plan,
             "fsdp2_clip": run_fsdp2_clip, "dcp": run_dcp, "fsdp2_load": more.run_fsdp2_load,
             "fsdp2_fused_ce": more.run_fsdp2_fused_ce, "zero_offload": more.run_zero_offload,
             "dcp_reshard": more.run_dcp_reshard, "ddp_delay": more.run_ddp_delay,
             "ddp_unused_async": more.run_ddp_unused_async, "fsdp2_norm_units": more.run_fsdp2_norm_units}[mode](rank)
        # FSDP2's modules and states form reference cycles: collected now, while the process group lives,
        # not at interpreter exit, where gloo work they still hold can abort the process (torch PR 179291).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: {mode} OK", flush=True)


if __name__ == "__main__":
    main()
    # Every check has passed and every OffloadAdam was closed (its threads joined) inside the run: leave
    # without the interpreter's finalization, where torch's gloo teardown once aborted a rank that had
    # finished ("terminate called without an active exception", exit -6 after "OK"; seen once in CI).
    os._exit(0)
