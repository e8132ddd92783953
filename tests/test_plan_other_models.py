"""effmem plan on models other than a causal LM, and on models it must not trace as they are: an encoder-decoder's
two stacks checkpointed, a classifier's layers not taken for logits, float inputs in the traced dtype, the user's
inputs callable and the default inputs' failures named, a config naming another head refused, a model already
under a memory technique refused (reviewers' runs)."""
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import effmem
from effmem.plan.trace import kind_of

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def _bert_classifier():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _classifier_inputs(batch, seq, device):
    return (), {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device),
                "labels": torch.zeros(batch, dtype=torch.long, device=device)}


def test_an_encoder_decoder_s_checkpointing_keeps_its_encoder_layers_inputs_only():
    """The trace took the decoder's layers alone, so under checkpointing every encoder save counted as kept:
    3.3x the measured activations here (3.8x a reviewer's T5, 8.6x a Bart's under checkpoint8); 0.97x now."""
    from effmem.plan.verify import verify
    torch.manual_seed(0)
    m = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=256, d_kv=32, d_ff=1024, num_layers=3, num_decoder_layers=3, num_heads=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    p = effmem.plan(m, batch=2, seq=256, device="cpu")   # big enough for the graph's own objects not to count
    (row,) = verify(p, candidates=["fp32+checkpoint+mb2x1"], steps=1, warmup=0)
    ratio = row["predicted_activation_bytes"] / row["measured_activation_bytes"]
    assert 0.9 < ratio < 1.1, ratio


def test_a_classifier_s_layers_are_not_charged_as_logits():
    """kind_of matched BERT's layer.N.output (its MLP's last product) to the output head's words: a two-label
    classifier's layers were charged 4.2 GB of logits, and the loss's transient sized from them."""
    assert kind_of("bert.encoder.layer.0.output.dropout", True, False) == "block"
    assert kind_of("bert.encoder.layer.0.attention.output.dense", True, False) == "attention"
    assert kind_of("lm_head", False, False) == "logits"
    p = effmem.plan(_bert_classifier(), batch=4, seq=64, device="cpu", inputs=_classifier_inputs)
    parts = p.candidate("fp32+mb4x1").as_dict()["parts"]
    assert parts["logits"] < 1024 < parts["activations"]


def test_float_inputs_are_traced_and_verified_in_the_candidate_s_dtype():
    """The inputs callable is not told the dtype: a CNN's float32 images met bf16 weights in the bf16 trace,
    which raised ("Input type (float) and bias type (c10::BFloat16) should be the same")."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return x + F.relu(self.c(x))

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.layers, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.ModuleList(
                Block() for _ in range(3)), nn.Linear(8, 10)

        def forward(self, x, y):
            x = self.stem(x)
            for b in self.layers:
                x = b(x)
            return F.cross_entropy(self.head(x.mean((2, 3))), y)

    def images(batch, seq, device):
        return (torch.randn(batch, 3, 16, 16, device=device), torch.zeros(batch, dtype=torch.long, device=device)), {}
    p = effmem.plan(CNN(), batch=2, seq=8, device="cpu", inputs=images)
    bf16 = [c.name for c in p.candidates if c.name.startswith("bf16") and c.fits]
    assert bf16 and p.pick is not None
    # verify's steps take them so too (a reviewer's run: they raised as the trace had)
    from effmem.plan.verify import verify
    row, = verify(p, candidates=bf16[:1], steps=1, warmup=0, inputs=images)
    assert row["measured_activation_bytes"] > 0


def test_the_user_s_inputs_callable_failing_is_named():
    """A callable that raised or returned no (args, kwargs) was taken for a model that cannot be traced: the plan
    fell back on the closed form (18 candidates instead of 210), its note naming neither."""
    m = _bert_classifier()
    with pytest.raises(ValueError, match=r"inputs: expected the callable to return \(args, kwargs\).*got Tensor"):
        effmem.plan(m, batch=2, seq=32, device="cpu",
                    inputs=lambda b, s, d: torch.zeros(b, s, dtype=torch.long, device=d))
    with pytest.raises(ValueError, match="inputs: the callable raised KeyError"):
        effmem.plan(m, batch=2, seq=32, device="cpu", inputs=lambda b, s, d: {}["boom"])
    with pytest.raises(ValueError, match=r"got \(tuple, list\)"):
        effmem.plan(m, batch=2, seq=32, device="cpu", inputs=lambda b, s, d: ((), []))
    # a tokenizer's BatchEncoding is a mapping, not a dict; args in a list
    encoded = lambda b, s, d: ([], transformers.BatchEncoding(_classifier_inputs(b, s, d)[1]))
    assert effmem.plan(m, batch=2, seq=32, device="cpu", inputs=encoded).pick is not None


def test_a_module_the_default_inputs_do_not_fit_is_told_to_pass_inputs():
    """A classifier's labels are not token-shaped: the trace failed inside transformers, naming neither the
    inputs nor the way out."""
    from effmem.plan.trace import TraceFailed
    with pytest.raises(TraceFailed, match=r"Expected input batch_size.*default inputs.*pass inputs=callable") as e:
        effmem.plan(_bert_classifier(), batch=2, seq=32, device="cpu")
    assert isinstance(e.value.__cause__, TraceFailed) and "Expected input" in str(e.value.__cause__)
    # a module without a vocabulary gets default_inputs' own refusal, as it was (no hint about token ids)
    with pytest.raises(TypeError, match="does not know how to call Sequential; pass inputs=") as e:
        effmem.plan(nn.Sequential(nn.ModuleList([nn.Linear(4, 4)])), batch=2, seq=8, device="cpu")
    assert "default inputs" not in str(e.value)


def test_a_config_naming_another_head_is_refused(tmp_path):
    """A config.json of BertForSequenceClassification was planned as BertLMHeadModel (AutoModelForCausalLM):
    another parameter count and 4 GB of logits for two labels, without a word."""
    cfg = dict(architectures=["BertForSequenceClassification"], model_type="bert", vocab_size=128, hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="BertForSequenceClassification, not a causal language model"):
        effmem.plan(str(path), batch=2, seq=32, device="cpu")
    for name in ("Qwen2ForProcessRewardModel", "Wav2Vec2ForCTC", "LlamaForQuestionAnswering"):   # any other head
        path.write_text(json.dumps(dict(cfg, architectures=[name])))
        with pytest.raises(ValueError, match=f"{name}, not a causal language model"):
            effmem.plan(str(path), batch=2, seq=32, device="cpu")
    # a masked LM's head is the vocabulary's logits and loss, planned alike; a draft model's name is no head
    for names in (["BertLMHeadModel"], ["BertForMaskedLM"], ["LlamaForCausalLMEagle3"], ["TransFormerModel"],
                  ["XForYForCausalLM"]):   # the last For<Head> counts
        path.write_text(json.dumps(dict(cfg, architectures=names, is_decoder=True)))
        assert effmem.plan(str(path), batch=2, seq=32, device="cpu").pick is not None


@pytest.mark.parametrize("technique", ["policy", "compress"])
def test_a_model_under_a_technique_is_refused(technique):
    """Traced as it was, a model under "fast" had its "kept" candidate predicted at 1/18 of plain's activations
    and its "fast" candidates dropped; under compress_activations, 0 bytes; plan.apply refused it, plan not."""
    from activation_helpers import tiny_llama
    m = tiny_llama(torch.float32, num_hidden_layers=2)
    if technique == "policy":
        effmem.apply_activation_policy(m, "fast")
    else:
        effmem.compress_activations(m)
    with pytest.raises(ValueError, match="already on it; plan\\(\\) traces the model as it was built"):
        effmem.plan(m, batch=2, seq=32, device="cpu")


def test_min_is_left_out_where_the_policy_refuses_the_model():
    """A Mixtral trained with its router's auxiliary loss (output_router_logits=True): the plan listed 'min'
    (checkpoint8) candidates as fitting, which apply() then refused, after it had fused the loss into the model (a
    reviewer's run). The plan now leaves them out and says why; apply() of such a candidate planned without the
    router's loss refuses before it changes the model."""
    from transformers import MixtralConfig, MixtralForCausalLM

    def mixtral(router_loss):
        torch.manual_seed(0)
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=router_loss)).train()
    plan = effmem.plan(mixtral(True), batch=4, seq=32, device="cpu")
    assert plan.candidates and not [c for c in plan.candidates if "checkpoint8" in c.name]
    assert any("checkpoint8" in n and "output_router_logits" in n for n in plan.notes), plan.notes
    planned = effmem.plan(mixtral(False), batch=4, seq=32, device="cpu")
    name = next(c.name for c in planned.candidates if "checkpoint8" in c.name and "fused" in c.name)
    model = mixtral(True)
    with pytest.raises(ValueError, match="'min' policy, and for this model 'min' keeps nothing"):
        planned.apply(model, candidate=name)
    from effmem.plan.model import techniques_on
    assert techniques_on(model, fused_loss=False) == []   # the loss was fused before the refusal
