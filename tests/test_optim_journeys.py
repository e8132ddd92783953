"""What users met with the optimizers: checkpoints exchanged between 8-bit and float32 moments over
parameters laid out differently in memory, a checkpoint loaded before the model's weights (or carried
through torch's AdamW), torch's load_state_dict hooks, a FusedAdam copied or pickled, a second optimizer
over parameters an open OffloadAdam steps, a clip factor left by a skipped step, and a float state_bits."""
import copy
import io
import warnings

import pytest
import torch

from effmem import FusedAdam, OffloadAdam
from offload_helpers import finish_step

CL, C = torch.channels_last, torch.contiguous_format


def _close(opt):
    """OffloadAdam's engine threads stop at close(); FusedAdam has none."""
    if isinstance(opt, OffloadAdam):
        opt.close()
SHAPE = (8, 16, 3, 3)


def _param(layout):
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(SHAPE).contiguous(memory_format=layout))


def _grad():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=g) * torch.linspace(0.01, 10, 8).view(-1, 1, 1, 1)


def _moments(cls, layout, bits, state=None):
    """exp_avg after one step from zero ((1 - beta1) * grad), or after loading `state`, as float32."""
    p = _param(layout)
    opt = cls([p], lr=1e-2, state_bits=bits)
    if state is None:
        p.grad = _grad()
        opt.step()
    else:
        opt.load_state_dict(state)
    sd = opt.state_dict()
    if bits == 8:   # decoded by a float32 optimizer over a parameter of the same layout
        q = _param(layout)
        reader = FusedAdam([q], lr=1e-2)
        reader.load_state_dict(sd)
        sd = reader.state_dict()
    _close(opt)
    return sd, sd["state"][0]["exp_avg"]


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("saved,loaded", [((C, 32), (CL, 8)), ((CL, 8), (C, 32)), ((CL, 8), (C, 8)),
                                          ((C, 8), (CL, 8)), ((CL, 32), (C, 32))])
def test_moments_survive_a_checkpoint_between_memory_layouts(cls, saved, loaded):
    """The 8-bit blocks run along memory: a channels_last parameter's codes are in another order than a
    contiguous one's. Loading across layouts (and formats) keeps every moment within 8-bit rounding."""
    true = 0.1 * _grad()
    sd, _ = _moments(cls, *saved)
    _, got = _moments(cls, *loaded, state=sd)
    assert ((got - true).abs().max() / true.abs().max()).item() < 0.03


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
def test_an_8bit_checkpoint_of_the_same_layout_loads_bit_for_bit(cls):
    p = _param(CL)
    first = cls([p], lr=1e-2, state_bits=8)
    p.grad = _grad()
    first.step()
    sd = first.state_dict()
    p = _param(CL)
    opt = cls([p], lr=1e-2, state_bits=8)
    opt.load_state_dict(sd)
    again = opt.state_dict()["state"][0]
    for key in ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(again[key], sd["state"][0][key])
    _close(opt)


def _linear(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).to(dtype)


def _train(m, opt, steps, seed=2):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)).to(m.weight.dtype)
    for _ in range(steps):
        m(x).float().square().mean().backward()
        finish_step(opt)


@pytest.mark.parametrize("cls", [OffloadAdam, FusedAdam])
@pytest.mark.parametrize("source", ["same", torch.optim.AdamW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_resumes_from_weights_loaded_after_the_optimizers_checkpoint(cls, source, dtype):
    """opt.load_state_dict(...) and then model.load_state_dict(...), both before the first step. A float32
    parameter is its own master, and a checkpoint without masters (torch's AdamW's) takes them from the
    parameters at the first step: both resume from the model's weights as loaded. Before, FusedAdam took a
    bf16 master at load time, from the random-init weights, and threw the loaded weights away."""
    m = _linear(dtype)
    opt = (cls if source == "same" else source)(m.parameters(), lr=1e-2)
    _train(m, opt, 2)
    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    _close(opt)
    m2 = _linear(dtype)
    m2.weight.data.add_(1.0)   # fresh weights, different from the checkpoint's
    opt2 = cls(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])   # the optimizer first ...
    m2.load_state_dict(ckpt["model"])    # ... then the weights
    m3 = _linear(dtype)
    m3.load_state_dict(ckpt["model"])    # the other order: the reference
    opt3 = cls(m3.parameters(), lr=1e-2)
    opt3.load_state_dict(ckpt["opt"])
    _train(m2, opt2, 2)
    _train(m3, opt3, 2)
    assert all(torch.equal(a, b) for a, b in zip(m3.parameters(), m2.parameters()))
    assert (m2.weight - ckpt["model"]["weight"]).abs().max() < 0.1   # trained on from the checkpoint
    _close(opt2)
    _close(opt3)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, FusedAdam, OffloadAdam])
def test_load_state_dict_hooks_work_as_for_torchs_optimizers(cls):
    """A pre-hook sees the whole checkpoint and what it returns is loaded (a migration of old key names, say);
    a post-hook sees the loaded state, and what it changes stays. Before, effmem's optimizers ran both hooks
    around an empty state and then loaded the checkpoint as given."""
    m = _linear(torch.float32)
    opt = cls(m.parameters(), lr=1e-2)
    _train(m, opt, 1)
    old = opt.state_dict()
    old["state"] = {k: {("m" if key == "exp_avg" else key): v for key, v in s.items()} for k, s in old["state"].items()}
    _close(opt)
    opt = cls(m.parameters(), lr=1e-2)
    seen = {}

    def migrate(optimizer, sd):
        seen["pre"] = len(sd["state"])
        sd = dict(sd, state={k: {("exp_avg" if key == "m" else key): v for key, v in s.items()}
                             for k, s in sd["state"].items()})
        return sd

    def after(optimizer):
        seen["post"] = sorted(float(s["step"]) for s in optimizer.state.values())
        for s in optimizer.state.values():
            s["exp_avg"].zero_()

    opt.register_load_state_dict_pre_hook(migrate)
    opt.register_load_state_dict_post_hook(after)
    opt.load_state_dict(old)
    assert seen == {"pre": 2, "post": [1.0, 1.0]} and "m" in old["state"][0]   # the caller's dict untouched
    assert all(not s["exp_avg"].any() and s["exp_avg_sq"].any() for s in opt.state_dict()["state"].values())
    _close(opt)


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("bits", [32, 8])
def test_a_state_dict_post_hook_sees_the_finished_checkpoint_and_may_rekey_it(cls, bits):
    """torch's contract: post-hooks see the finished state dict and may return another (keyed by parameter name,
    say). Before, effmem finished it after the hooks: 8-bit state raised TypeError (its scales looked up by
    integer key), and OffloadAdam's masters pending from a torch checkpoint went out as zeros (reviewer's repros)."""
    m = _linear(torch.bfloat16)
    torch_opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, torch_opt, 1)
    opt = cls(m.named_parameters(), lr=1e-2, state_bits=bits)
    opt.load_state_dict(torch_opt.state_dict())   # no masters: each is taken from its parameter
    if cls is OffloadAdam:   # opt.state showed zeros (the engine's buffer) until the next step
        assert all(torch.equal(opt.state[p]["master"], p.detach().float()) for p in m.parameters())
    names = [n for n, _ in m.named_parameters()]
    seen = []

    def by_name(optimizer, sd):
        seen.append(sorted(sd["state"][0]))
        return dict(sd, state={names[k]: v for k, v in sd["state"].items()})

    opt.register_state_dict_post_hook(by_name)
    sd = opt.state_dict()
    moments = ["exp_avg", "exp_avg_sq"] if bits == 32 else ["exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes",
                                                           "exp_avg_sq_scale"]
    # FusedAdam's entries take their masters at the next step; OffloadAdam's engine holds them already
    master = ["master"] if cls is OffloadAdam else []
    assert seen == [sorted(moments + master + ["step"])] and sorted(sd["state"]) == ["bias", "weight"]
    for name, p in m.named_parameters():
        assert torch.equal(sd["state"][name].get("master", p.detach().float()), p.detach().float())
    _close(opt)


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_fused_adam_trains_on_its_own(bits, how):
    """copy.deepcopy((model, opt)) or torch.save of both, as for torch's optimizers: the copy steps its own
    model exactly as the original steps its, in the same format. Before, the copy lost state_bits and its
    first step raised AttributeError."""
    m = _linear(torch.bfloat16)
    opt = FusedAdam(m.parameters(), lr=1e-2, state_bits=bits)
    _train(m, opt, 2)
    if how == "deepcopy":
        m2, opt2 = copy.deepcopy((m, opt))
    else:
        buf = io.BytesIO()
        torch.save((m, opt), buf)
        buf.seek(0)
        m2, opt2 = torch.load(buf, weights_only=False)
    _train(m, opt, 2, seed=5)
    _train(m2, opt2, 2, seed=5)
    assert opt2.state_bits == bits and opt2.defaults == opt.defaults
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    opt2.load_state_dict(opt.state_dict())   # and it still takes checkpoints


@pytest.mark.parametrize("second", [OffloadAdam, FusedAdam])
def test_a_second_optimizer_over_an_open_offload_adams_parameters_is_refused(second):
    m = torch.nn.Linear(4, 2)
    first = OffloadAdam(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="params: parameter 0 .* another OffloadAdam, still open"):
        second(m.parameters(), lr=0.1)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="another OffloadAdam"):   # nor a group added later
        FusedAdam(other.parameters(), lr=0.1).add_param_group({"params": [m.weight]})
    first.close()
    again = second(m.parameters(), lr=0.1)   # closed: the parameters are free
    m(torch.randn(3, 4)).sum().backward()
    before = m.weight.detach().clone()
    again.step()
    assert not torch.equal(before, m.weight)
    _close(again)


def test_a_dropped_offload_adam_frees_its_parameters():
    m = torch.nn.Linear(4, 2)
    opt = OffloadAdam(m.parameters(), lr=0.1)
    del opt   # __del__ closes it
    OffloadAdam(m.parameters(), lr=0.1).close()


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
def test_a_clip_factor_of_a_skipped_step_does_not_reach_the_next(cls):
    """clip_grad_norm_, then the step skipped on a spiking norm (zero_grad and go on): the next step is as if
    the spike never happened."""
    def update(skip_first):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = cls([p], lr=1.0, betas=(0.0, 0.0), eps=1.0, bias_correction=False)   # update g / (|g| + 1)
        if skip_first:
            p.grad = torch.full((4,), 1e6)
            assert opt.clip_grad_norm_(1.0) > 1e3
            opt.zero_grad()
        p.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
        opt.step()
        _close(opt)
        return p.detach()

    assert torch.equal(update(False), update(True))


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam])
@pytest.mark.parametrize("bits", [8.0, "8", 16])
def test_state_bits_must_be_the_int_8_or_32(cls, bits):
    with pytest.raises(ValueError, match="state_bits: expected 32 .* or 8"):
        cls([torch.nn.Parameter(torch.zeros(3))], state_bits=bits)


@pytest.mark.parametrize("cls", [FusedAdam, OffloadAdam, None])
def test_max_norm_may_be_a_tensor_as_in_torch(cls):
    """torch.nn.utils.clip_grad_norm_ takes a tensor max_norm; so do effmem's clips, with the same factor."""
    def clipped(max_norm):
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
        if cls is None:
            from effmem import clip_grad_norm_
            clip_grad_norm_([p], max_norm)
            return p.grad.clone()
        opt = cls([p], lr=1.0, betas=(0.0, 0.0), eps=1.0, bias_correction=False)
        opt.clip_grad_norm_(max_norm)
        opt.step()
        _close(opt)
        return p.detach().clone()

    assert torch.equal(clipped(1.0), clipped(torch.tensor(1.0))) and torch.equal(clipped(1.0),
                                                                              clipped(torch.tensor(1.0).double()))
    with pytest.raises(ValueError, match="max_norm: expected a value >= 0"):
        clipped(torch.tensor(-1.0))


def test_clip_names_norm_type_when_it_is_not_a_number():
    from effmem import clip_grad_norm_
    with pytest.raises(ValueError, match="norm_type: only the L2 norm"):
        clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0, norm_type="fro")


@pytest.mark.parametrize("mode", [{}, {"delay": True}, {"async_step": True}])
def test_offload_state_has_an_entry_once_stepped_in_every_mode(mode):
    """opt.state as torch's: no entry before the first step (torch.distributed.checkpoint then runs its lr-0
    step to make them), one for each parameter given a gradient right after step() even while the engine
    still runs the update (async_step, delay: DCP read an empty state there and took a second step), and a
    read of opt.state[p] before the first step (torch's defaultdict makes an empty entry) does not hide it."""
    m = _linear(torch.float32)
    opt = OffloadAdam(m.parameters(), lr=1e-2, **mode)
    if mode.get("async_step"):
        opt.attach(m)
    assert not opt.state and opt.state[m.weight] == {}
    _train(m, opt, 1)
    assert all(sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"] for p in m.parameters())
    assert len(opt.state_dict()["state"]) == 2 and float(opt.state[m.weight]["step"]) == 1.0
    opt.close()


def test_overlap_buckets_updated_in_a_backward_without_step_get_their_state_entries():
    """overlap=True updates buckets during backward; a loop that then skips the step (zero_grad) leaves
    them stepped, and opt.state must show it (DCP takes an empty state for a fresh optimizer)."""
    m = _linear(torch.float32)
    opt = OffloadAdam(m.parameters(), lr=1e-2, overlap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the usual loop (backward, step, zero_grad) warns of nothing
        for _ in range(2):
            m(torch.randn(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    m(torch.randn(4, 8)).square().sum().backward()
    # a GAN's discriminator phase run through the generator updated the generator's overlap optimizer,
    # which then only called zero_grad(): it stepped twice per iteration, without a word
    with pytest.warns(UserWarning, match=r"zero_grad\(\) after a backward that updated parameters, with no step"):
        opt.zero_grad()
    assert len(opt.state) == 2 and all(float(opt.state[p]["step"]) == 3.0 for p in m.parameters())
    opt.close()


def test_fused_adam_refuses_to_make_state_inside_a_cuda_graph_capture(monkeypatch):
    """A capture records the state's creation too, and every replay would zero the moments again (or copy
    the bf16 parameter into the master of a checkpoint loaded without one). Capture is stood in for here:
    the check is on the host."""
    from effmem.optim import fused_adam
    m = _linear(torch.bfloat16)
    opt = FusedAdam(m.parameters(), lr=1e-2)
    m(torch.randn(2, 8).bfloat16()).float().sum().backward()
    with monkeypatch.context() as patch:
        patch.setattr(fused_adam, "_capturing", lambda: True)
        with pytest.raises(RuntimeError, match=r"inside a CUDA graph capture.*run one step before capturing"):
            opt.step()
    opt.step()   # the warm-up step
    sd = opt.state_dict()
    for s in sd["state"].values():
        del s["master"]   # as torch's AdamW checkpoints: masters taken from the parameters at the next step
    refusals = opt._refusals
    opt.load_state_dict(sd)
    assert opt._refusals is refusals   # torch's loader calls __setstate__: a pending refusal must survive it
    with monkeypatch.context() as patch:
        patch.setattr(fused_adam, "_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
            opt.step()
    opt.step()
    with monkeypatch.context() as patch:
        patch.setattr(fused_adam, "_capturing", lambda: True)
        opt.step()   # the state exists: captured steps are fine


MODES = {"default": {}, "delay": {"delay": True}, "async_step": {"async_step": True}, "overlap": {"overlap": True}}


@pytest.mark.parametrize("mode", ["default", "delay", "async_step"])
@pytest.mark.parametrize("model_first", [True, False])
def test_a_rollback_in_place_resumes_from_the_checkpoint(mode, model_first):
    """Checkpoint, one more step, then load the checkpoint back into the same model and optimizer: the
    weights are the checkpoint's and training goes on as from it. Under delay and async_step the abandoned
    step's update was still pending, and loading the optimizer installed it over the model weights just
    loaded (model first), without a word."""
    from offload_helpers import batches, tiny_gpt, train
    data = batches(6)
    m = tiny_gpt(torch.bfloat16)
    opt = OffloadAdam(m.parameters(), lr=1e-2, **MODES[mode])
    if mode == "async_step":
        opt.attach(m)
    train(m, opt, data[:2])
    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    train(m, opt, data[2:3])   # the step to abandon
    for load in ((lambda: m.load_state_dict(ckpt["model"])), (lambda: opt.load_state_dict(ckpt["opt"])))[
            ::1 if model_first else -1]:
        load()
    assert all(torch.equal(p, ckpt["model"][n]) for n, p in m.named_parameters())
    train(m, opt, data[3:])
    fresh = tiny_gpt(torch.bfloat16)
    fresh.load_state_dict(ckpt["model"])
    ref = OffloadAdam(fresh.parameters(), lr=1e-2, **MODES[mode])
    if mode == "async_step":
        ref.attach(fresh)
    ref.load_state_dict(ckpt["opt"])
    train(fresh, ref, data[3:])
    for o in (opt, ref):
        o.flush()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), fresh.parameters()))
    opt.close()
    ref.close()


@pytest.mark.parametrize("mode", ["overlap", "delay"])
def test_nested_accumulating_blocks_stay_accumulating_until_the_outermost_ends(mode):
    """An inner `with opt.accumulating()` (a helper's own) ending before the outer block's backward turned
    accumulation off: overlap updated after the first micro-batch and refused the second, delay installed
    weights early."""
    from offload_helpers import batches, tiny_gpt

    def run(nested):
        m = tiny_gpt(torch.float32)
        opt = OffloadAdam(m.parameters(), lr=1e-2, **MODES[mode])
        for k in range(3):
            (x0, y0), (x1, y1) = batches(2, seed=k)
            with opt.accumulating():
                if nested:
                    with opt.accumulating():
                        pass
                m(x0, y0)[1].backward()
            m(x1, y1)[1].backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        opt.close()
        return [p.detach().clone() for p in m.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_meta_parameters_are_not_taken_for_views_of_one_tensor():
    """Every meta tensor's data_ptr is 0: two meta parameters "shared memory" and both optimizers refused
    them with that, where torch's AdamW takes them (a model built on the meta device, then to_empty)."""
    m = torch.nn.Linear(4, 4, device="meta")
    FusedAdam(m.parameters())
    with pytest.raises(ValueError, match="params: expected CPU or CUDA parameters, got meta"):
        OffloadAdam(m.parameters())
