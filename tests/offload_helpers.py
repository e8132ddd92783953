"""Helpers shared by the OffloadAdam tests (tests/test_offload*.py)."""
import torch

from effmem import OffloadAdam, demo_model

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def tiny_gpt(dtype, n_layer=2, d_model=32, seq_len=16):
    torch.manual_seed(0)
    cfg = demo_model.GPTConfig(seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=2)
    return demo_model.ByteGPT(cfg).to(dtype)


def batches(n, b=4, t=16, seed=0):
    """Random bytes and a learnable target (a fixed permutation of each byte)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (b, t), generator=gen)
        out.append((x, (x * 7 + 3) % 256))
    return out


def train(model, opt, data, *, accum=1, clip=None, sched=None):
    """The ordinary loop; `accum` micro-batches per step. Returns the losses."""
    losses = []
    for k in range(0, len(data), accum):
        for j, (x, y) in enumerate(data[k:k + accum]):
            ctx = opt.accumulating() if (isinstance(opt, OffloadAdam) and j < accum - 1) else _null()
            with ctx:
                _, loss = model(x, y)
                (loss / accum).backward()
            losses.append(loss.item())
        finish_step(opt, clip, sched)
    return losses


def backward_both(ref, model, opt, micro):
    """The micro-batches `micro` ((x, y) pairs) through a reference model (its gradients summed in p.grad)
    and through `model`, whose OffloadAdam takes all but the last inside accumulating()."""
    accum = len(micro)
    for j, (x, y) in enumerate(micro):
        (ref(x, y)[1] / accum).backward()
        with opt.accumulating() if j < accum - 1 else _null():
            (model(x, y)[1] / accum).backward()


def finish_step(opt, clip=None, sched=None):
    """Clip (when asked), step, zero the gradients, advance the schedule."""
    if clip is not None:
        opt.clip_grad_norm_(clip)
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same_training(a, b, opt_a, opt_b, exact=True):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(pa, pb), name
        else:
            assert torch.allclose(pa.float(), pb.float(), rtol=1e-6, atol=0), name
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k, st in sa["state"].items():
        assert st.keys() == sb["state"][k].keys()
        for key, value in st.items():
            other = sb["state"][k][key]
            if exact or key == "step":
                assert torch.equal(value.cpu().float(), other.cpu().float()), (k, key)
            else:
                assert torch.allclose(value.cpu().float(), other.cpu().float(), rtol=1e-6, atol=1e-12), (k, key)
