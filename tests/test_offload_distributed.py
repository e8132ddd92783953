"""OffloadAdam under DDP and FSDP2: two processes on one machine, CPU tensors, gloo.

Each rank offloads what it owns (DDP: every parameter; FSDP2: the local
shard of each DTensor) and must match FusedAdam run on the same gradients;
the checks run inside the ranks (tests/distributed_worker.py). "fsdp2_async": async_step under FSDP2
trains exactly as plain OffloadAdam (its weights installed before FSDP all-gathers them). "plan": effmem.plan's
DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2) picks, applied by plan.apply on each rank, train as one
process does on both ranks' batches. "fsdp2_clip": FusedAdam's and effmem's clips over sharded gradients.
"dcp": a resume through torch.distributed.checkpoint of FusedAdam and OffloadAdam, bit for bit. "fsdp2_load":
loads on shards of one row or none and across moment formats. "ddp_late": OffloadAdam built before the ranks.
"fsdp2_fused_ce": the fused loss with lm_head an FSDP2 unit of its own. "zero_offload":
ZeroRedundancyOptimizer over OffloadAdam, resumed bit for bit. "dcp_reshard": 8-bit state saved by DCP on one
mesh, loaded on another. "ddp_delay": delay=True with attach_ddp trains as without it. "ddp_unused_async":
async_step with a branch only one rank runs (find_unused_parameters=True) trains as FusedAdam.
"fsdp2_norm_units": "fast" with norms that are FSDP2 units of their own.
"""
import os
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "fsdp2_async", "plan", "fsdp2_clip", "dcp", "fsdp2_load",
                                  "ddp_late", "fsdp2_fused_ce", "zero_offload", "dcp_reshard", "ddp_delay",
                                  "ddp_unused_async", "fsdp2_norm_units"])
def test_two_ranks(mode, tmp_path):
    store = tmp_path / "store"
    # gloo connects the ranks over the loopback interface: on a machine without a network the
    # default (the interface of the host name) may not resolve, and the ranks would wait forever.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(rank), "2", str(store)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append((p.returncode, out, err))
    for rank, (code, out, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{out}\n{err[-4000:]}"
        assert f"rank {rank}: {mode} OK" in out
