"""The C++ saved-tensor hooks (effmem._C.SavedTensors, csrc/saved/) against the Python rules they stand in for.

The "fast" policy's pack hook decides in C++ what the Python rules (FastCompressor._pack, which a
compressor with records on uses for every save) would decide: the same statistics, the same stored bytes and
bit-identical gradients on Hugging Face Llama and GPT-2 models and the demo GPT. A save changed in place
after it was saved is torch's RuntimeError for each kind of save (kept, compressed, rebuilt), as autograd
raises it without hooks. Nested tensors (no single shape or strides) are kept as they are.
"""
import copy
import warnings

import pytest
import torch

from effmem.activations import activation_stats, apply_activation_policy, fused
from effmem.activations.fast import FastCompressor
from effmem.compress import compress_activations
from effmem.demo_model import ByteGPT, GPTConfig
from activation_helpers import loss_of, tiny_llama

transformers = pytest.importorskip("transformers")


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).train()


def demo_gpt():
    torch.manual_seed(0)
    return ByteGPT(GPTConfig(seq_len=128, n_layer=2, d_model=64, n_head=4)).train()


def bamba():
    """A Mamba2 hybrid on transformers' torch path (no mamba_ssm here): its decays exp(segsum(A)) are saved."""
    cfg = transformers.BambaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, use_cache=False, mamba_d_state=8,
                                   mamba_n_heads=4, mamba_d_head=32, attn_layer_indices=[1], mamba_chunk_size=16)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.BambaForCausalLM(cfg).train()


MODELS = {"llama": tiny_llama, "llama_bf16": lambda: tiny_llama(torch.bfloat16), "gpt2": gpt2, "demo_gpt": demo_gpt,
          "bamba": bamba}


def run(model, python_rules: bool):
    model = apply_activation_policy(model, "fast")
    comp = model._effmem_fast
    if python_rules:
        comp._pack_hook = comp._pack  # what a compressor with records on pushes
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))
    loss_of(model, ids).backward()
    return activation_stats(model).as_dict(), [p.grad for p in model.parameters()], comp._saves


@pytest.mark.parametrize("which", list(MODELS))
def test_cpp_hooks_decide_as_the_python_rules(which):
    cpp_stats, cpp_grads, cpp = run(MODELS[which](), python_rules=False)
    py_stats, py_grads, py = run(MODELS[which](), python_rules=True)
    assert cpp_stats["num_compressed"] > 0 and cpp_stats["deduplicated"] > 0
    assert cpp_stats == py_stats
    assert cpp.quantize_calls == py.quantize_calls and cpp.dequantize_calls == py.dequantize_calls
    assert cpp.rebuild_calls == py.rebuild_calls > 0
    for a, b in zip(cpp_grads, py_grads):
        assert (a is None and b is None) or torch.equal(a, b)


def test_exp_outputs_are_kept_as_they_are():
    """Mamba2's intra-chunk decays, exp of segment sums, run from 1 down to 0 within a group: 8-bit codes of one
    step per group rounded the small ones away and Bamba's A_log gradient came out 14.8% off plain float32's
    (plain bf16: 1.2%, a reviewer's find). exp's outputs are kept as they are now: within 3%."""
    ref, model = bamba(), bamba()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))   # run()'s batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_of(ref, ids).backward()
        stats, grads, _ = run(model, python_rules=False)
    assert stats["skipped"]["exponential"]["count"] == 2   # one per Mamba2 mixer
    a, b = ref.model.layers[0].mamba.A_log.grad, model.model.layers[0].mamba.A_log.grad
    assert ((a - b).norm() / a.norm()).item() < 0.03


def test_a_fused_attentions_output_is_kept_as_it_is_and_counted_once():
    """With outlier channels in the residual stream (trained LLMs'), a flash attention's output is nearly one
    vector shared by every token; stored in 8 bits it no longer matched the exact log-sum-exp its backward
    reads beside it, and the worst gradient of bench/activation_outliers.py's Llama was 22.8% off float32's
    (7.9% kept as it is; plain bf16 4.1%). The output projection saves the same memory: counted once."""
    from test_bench_activations import load_bench
    outliers = load_bench("activation_outliers")
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    m = outliers.model(512, 30.0)
    ref = outliers.gradients(copy.deepcopy(m), ids)
    fast = apply_activation_policy(copy.deepcopy(m).to(torch.bfloat16), "fast")
    _, error = outliers.worst(outliers.gradients(fast, ids), ref)
    assert error < 0.12
    kept = activation_stats(fast).skipped["attention_output"]
    assert kept.count == 2 * 2 and kept.bytes_before == 2 * ids.numel() * 512 * 2   # 2 saves, 1 memory a layer
    # compress_activations likewise: 15.8% before, 8.9%
    comp = compress_activations(copy.deepcopy(m).to(torch.bfloat16), bits=8)
    _, error = outliers.worst(outliers.gradients(comp, ids), ref)
    assert error < 0.12 and comp._effmem_compressor.stats.skipped["attention_output"].count == 4


def layer_of(comp, hidden):
    return comp.layer("layer", hidden, (), frozenset(), True)


@pytest.mark.parametrize("kind", ["kept", "compressed", "rebuilt"])
def test_a_save_changed_in_place_is_torch_error(kind):
    comp = FastCompressor(min_numel=1024)
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    with layer_of(comp, x):
        h = x * 2
        if kind == "kept":
            t = h[:4, :8] * 1          # 32 values: under min_numel, kept as it is
            out = t.sin()
        elif kind == "compressed":
            t = h                      # 8192 values: stored in 8 bits
            out = t.sin()
        else:
            t = fused.rms_norm(h, w, 1e-6)  # rebuilt in backward from h, not stored
            out = t.sin()
    # the save went the way the test means it to (rebuilt: h is saved by rms_norm and by its recipe, stored
    # once; t's save by sin holds the recipe)
    stats = comp.stats
    assert {"kept": stats.skipped.get("small") is not None, "compressed": stats.num_compressed == 1,
            "rebuilt": stats.num_compressed == 1 and stats.deduplicated == 2}[kind], stats
    with torch.no_grad():
        t.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_packed_saves_unpack_unchanged_without_in_place_changes():
    comp = FastCompressor(min_numel=1024)
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    with layer_of(comp, x):
        out = (fused.rms_norm(x * 2, w, 1e-6).sin() + (x * 3)[:4, :8].sum()).sum()
    out.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and w.grad is not None
    assert comp._saves.rebuild_calls == 1


@pytest.mark.parametrize("how", ["generic", "generic_records", "fast"])
def test_nested_tensors_are_kept_as_they_are(how):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        leaf = torch.nested.nested_tensor([torch.randn(300, 80), torch.randn(500, 80)], requires_grad=True)

        def loss():
            return torch.nested.to_padded_tensor((leaf * 2).sin(), 0.0).sum()
        loss().backward()
        want, leaf.grad = leaf.grad, None
        if how == "fast":
            comp = FastCompressor(min_numel=0)
            with comp.layer("layer", torch.randn(800, 80), (), frozenset(), True):
                out = loss()
            stats = comp.stats
        else:
            with compress_activations(min_numel=0, record=how == "generic_records") as ctx:
                out = loss()
            stats = ctx.stats
        out.backward()
    assert stats.skipped["unsupported"].count >= 1 and stats.num_compressed == 0, stats
    for a, b in zip(leaf.grad.unbind(), want.unbind()):
        assert torch.equal(a, b)


def test_a_handle_reaching_past_its_storage_is_refused():
    """effmem._C's classes are reachable from Python: a recipe handle claiming a million elements of a 4-element
    tensor made a view past its storage, and reading it crashed the process (a reviewer's SIGSEGV)."""
    import effmem

    class Owner:
        def _unpack_other(self, p):
            return p
    st = effmem._C.SavedTensors(8, 128, 0, False, Owner())
    recipe = st.add_recipe(torch.randn(4), lambda: torch.randn(4), [])
    with pytest.raises(ValueError, match=r"reach past its storage of 16 bytes"):
        st.unpack(effmem._C.RecipeHandle(recipe, [10 ** 6], [1], 10 ** 9))
    with pytest.raises(ValueError, match=r"reach past its storage"):   # 2^62 x 4 elements wrapped negative
        st.unpack(effmem._C.RecipeHandle(recipe, [2 ** 62], [4], 0))
    assert st.unpack(effmem._C.RecipeHandle(recipe, [2], [2], 1)).shape == (2,)   # inside it: a view as before
