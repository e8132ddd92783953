"""How OffloadAdam takes gradients over micro-batches, on the host transfer backend: summed on the device
and sent once (device_accumulation), and the clip norm's sums of squares taken as the last micro-batch's
gradients land. Each against the plain path, bit for bit."""
import copy

import pytest
import torch

from effmem import OffloadAdam
from offload_helpers import HP, _null, batches, tiny_gpt, train


@pytest.mark.parametrize("delay_us", [0.0, 50.0])
@pytest.mark.parametrize("accum", [1, 2])
def test_clip_norm_taken_as_the_gradients_land_is_the_same(delay_us, accum):
    """Once clipping is in use, the last micro-batch's gradients get their sums of squares as they land
    (during backward) instead of in a pass after it: the same norm and weights, bit for bit, as an
    optimizer that takes every gradient inside accumulating() (so it sums them afterwards), for gradients
    copied into the staging (accum 1) and added into it (accum 2), with copies landing late (the host
    backend's random delays)."""
    data = batches(12)
    ref = tiny_gpt(torch.bfloat16)
    models = [copy.deepcopy(ref), copy.deepcopy(ref)]
    opts = [OffloadAdam(m.parameters(), bucket_size=3000, _host_delay_us=delay_us, **HP) for m in models]
    norms = [[], []]
    for k in range(0, len(data), accum):
        for which, (m, opt) in enumerate(zip(models, opts)):
            for j, (x, y) in enumerate(data[k:k + accum]):
                with opt.accumulating() if (j < accum - 1 or which == 1) else _null():
                    (m(x, y)[1] / accum).backward()
            norms[which].append(opt.clip_grad_norm_(0.05))
            opt.step()
            opt.zero_grad()
    assert torch.equal(torch.stack(norms[0]), torch.stack(norms[1]))
    assert norms[0][-1] > 0.05   # the clip was active
    for pa, pb in zip(*(m.parameters() for m in models)):
        assert torch.equal(pa, pb)
    n = len(list(ref.parameters()))
    landed = [opt.counters()["landed_sq_sums"] for opt in opts]
    # every step after the first; none where every gradient was taken inside accumulating()
    assert landed == [n * (len(data) // accum - 1), 0]
    for opt in opts:
        opt.close()


@pytest.mark.parametrize("budget,mode,clip", [("all", "plain", None), ("some", "plain", None),
                                               ("some", "plain", 0.5), ("some", "overlap", None),
                                               ("some", "async_step", 0.5), ("some", "delay", 0.5)])
def test_device_accumulation_sends_once_and_changes_nothing(budget, mode, clip):
    """device_accumulation: gradients summed in p.grad over the micro-batches inside accumulating()
    and sent once; the same bits as summing them on the host, fewer bytes down (issue 12, item 3), in
    every mode and with clipping by global norm."""
    accum, steps = 4, 3
    data = batches(accum * steps)
    ref_model, model = tiny_gpt(torch.bfloat16), tiny_gpt(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    kw = {} if mode == "plain" else {mode: True}
    ref = OffloadAdam(ref_model.parameters(), **HP, bucket_size=n // 4, **kw)
    size = 2 * n if budget == "all" else n  # bytes: every bucket, or about half of them
    off = OffloadAdam(model.parameters(), **HP, bucket_size=n // 4, device_accumulation=size, **kw)
    if mode == "async_step":
        ref.attach(ref_model)
        off.attach(model)
    kept = sum(off._local[i].numel() for i in off._keep_on_device)
    assert kept == n if budget == "all" else 0 < kept < n
    train(ref_model, ref, data, accum=accum, clip=clip)
    train(model, off, data, accum=accum, clip=clip)
    ref.flush()
    off.flush()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    down_ref, down = ref.counters()["bytes_down"], off.counters()["bytes_down"]
    assert down_ref == steps * accum * 2 * n
    assert down == steps * 2 * (accum * (n - kept) + kept)
    with pytest.raises(ValueError, match="device_accumulation: expected an int >= 0"):
        OffloadAdam(model.parameters(), device_accumulation=-1)
    ref.close()
    off.close()
