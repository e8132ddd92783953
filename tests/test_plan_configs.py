"""effmem plan on configs as users hand them over: what transformers 5 writes (per-layer lists), models it
cannot plan, refused with a message that says why, and the trace against the closed-form count of presets."""
import json

import pytest

import effmem

transformers = pytest.importorskip("transformers")


def test_a_model_it_cannot_plan_gets_an_error_that_says_why(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the folder .* has no config.json"):
        effmem.plan(str(tmp_path / "empty"), batch=1, seq=16)
    with pytest.raises(ValueError, match="did you mean 'llama-7b'"):
        effmem.plan("Llama-7B", batch=1, seq=16)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ValueError, match="model_type 'no-such-model' is not one transformers"):
        effmem.plan(str(tmp_path / "odd"), batch=1, seq=16)
    transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=256).save_pretrained(
        tmp_path / "t5")
    with pytest.raises(ValueError, match="causal language models .* 't5' has none"):
        effmem.plan(str(tmp_path / "t5"), batch=1, seq=16)


def test_configs_with_per_layer_lists_are_planned(tmp_path):
    """transformers 5 writes layer_types (sliding or full attention per layer) into Qwen2's and Gemma2's
    configs; the planner's 1- and 2-layer copies cut the list to their own layers."""
    transformers.Qwen2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=256).save_pretrained(tmp_path)
    assert "layer_types" in json.loads((tmp_path / "config.json").read_text())
    p = effmem.plan(str(tmp_path), batch=1, seq=16, device="cpu", gpu_memory="1GB", host_memory="8GB")
    assert p.best is not None and p.method.startswith("trace")


@pytest.mark.parametrize("preset", ["llama-7b", "mistral-7b", "llama3-8b", "gpt2"])
def test_trace_agrees_with_the_closed_form_count(preset):
    """plan/formula.py, written from reading the modules, against the trace: two derivations, one number."""
    p = effmem.plan(preset, batch=2, seq=1024, gpu_memory="80GB", host_memory="1TB")
    check = p.formula_check
    assert check is not None and abs(check["relative_difference"]) < 1e-4, check
    assert any(n.startswith("cross-check") for n in p.notes)


def test_no_cross_check_where_the_cpu_runs_attention_with_dropout():
    """GPT-2 on a CPU: attention with dropout (attn_pdrop 0.1 by default) runs as the math, which keeps the
    weights the formula's flash attention does not, so the note read +58% as if one of the two were wrong."""
    p = effmem.plan("gpt2", batch=1, seq=256, device="cpu", gpu_memory="80GB", host_memory="1TB")
    assert p.formula_check is None and not any(n.startswith("cross-check") for n in p.notes)
    llama = effmem.plan("llama-1b", batch=1, seq=256, device="cpu", gpu_memory="80GB", host_memory="1TB")
    assert abs(llama.formula_check["relative_difference"]) < 1e-4


def test_no_formula_for_a_model_it_does_not_describe():
    p = effmem.plan("mixtral-8x7b", batch=1, seq=256, gpu_memory="80GB", host_memory="1TB")
    assert p.formula_check is None and p.as_dict()["formula_check"] is None
