"""Which stack of layers a policy takes in transformers models whose layers are not one list of one class, and what
memory_budget leaves out for a dtype "min" cannot code (each a reviewer's find)."""
import warnings

import pytest
import torch

import effmem
from effmem.activations import budget_choice, layer_stacks

transformers = pytest.importorskip("transformers")


def _zamba2():
    cfg = transformers.Zamba2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256, use_cache=False, layers_block_type=["mamba", "hybrid"] * 2, hybrid_layer_ids=[1, 3],
        mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, num_mem_blocks=1, chunk_size=16, pad_token_id=0)
    return transformers.Zamba2ForCausalLM(cfg)


def _mllama():
    tc = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, cross_attention_layers=[1, 3], pad_token_id=0)
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_global_layers=2, attention_heads=4,
              image_size=28, patch_size=14, max_num_tiles=4, vision_output_dim=64, intermediate_layers_indices=[0, 2])
    return transformers.MllamaForConditionalGeneration(transformers.MllamaConfig(text_config=tc, vision_config=vc))


@pytest.mark.parametrize("make, classes", [
    (_zamba2, "Zamba2HybridLayer, Zamba2MambaDecoderLayer"),
    (_mllama, "MllamaCrossAttentionDecoderLayer, MllamaSelfAttentionDecoderLayer")])
def test_a_decoder_whose_layers_are_of_several_classes_is_refused(make, classes):
    """The longest list of one class stood in for the layers: Zamba2's two LoRA adapters inside a hybrid layer,
    Mllama's vision tower (its language model ran plain), each silently. Refused now, naming the classes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make()
    assert layer_stacks(model) == []
    with pytest.raises(ValueError, match=f"decoder's layers are of 2 classes \\({classes}\\)"):
        effmem.apply_activation_policy(model, "fast")


def test_an_encoder_decoder_whose_decoder_is_the_whole_model_gets_both_stacks():
    """Florence2's get_decoder() is its whole BART, whose longest list is the encoder's where both are as long:
    the encoder's layers were taken twice and refused as 'a layer used more than once'."""
    vc = transformers.Florence2VisionConfig(
        embed_dim=[16, 32], depths=[1, 1], num_heads=[1, 2], num_groups=[1, 2], patch_size=[7, 3],
        patch_stride=[4, 2], patch_padding=[3, 1], patch_prenorm=[False, True], projection_dim=64)
    tc = dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=300,
              max_position_embeddings=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Florence2ForConditionalGeneration(transformers.Florence2Config(vision_config=vc,
                                                                                           text_config=tc))
    assert [n for n, _ in layer_stacks(model)] == ["model.language_model.encoder.layers",
                                                   "model.language_model.decoder.layers"]
    effmem.apply_activation_policy(model, "fast")
    wrapped = [n for n, m in model.named_modules() if m.__dict__.get("_effmem_policy")]
    assert len(wrapped) == 4 and sum(".decoder.layers." in n for n in wrapped) == 2


def test_memory_budget_leaves_min_out_for_hidden_states_its_codes_cannot_take():
    """A float64 model under memory_budget: "min" was chosen and raised a TypeError from inside the layer. It is
    left out now, and a budget only "min" would meet is refused before any layer runs, saying why."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, use_cache=False)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = effmem.apply_activation_policy(transformers.LlamaForCausalLM(cfg).double(), memory_budget=0.5)
    with pytest.raises(ValueError, match="'min' is left out: its 8-bit codes take .* not torch.float64"):
        model(input_ids=x, labels=x)


def test_min_is_refused_and_left_out_of_a_budget_where_later_layers_reuse_keys_and_values():
    """Gemma3n's last layers attend with keys and values earlier layers made (num_kv_shared_layers): "min", which
    keeps no graph of a layer's forward, failed in backward blaming outputs the user never asked for, and the
    budget chose it. Refused at apply now, and the budget leaves it out (a reviewer's find)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.Gemma3nTextConfig(
            vocab_size=256, vocab_size_per_layer_input=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            hidden_size_per_layer_input=16, num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2,
            sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
            activation_sparsity_pattern=[0.0] * 4, use_cache=False)
        torch.manual_seed(0)
        model = transformers.Gemma3nForCausalLM(cfg)
    with pytest.raises(ValueError, match="last 2 layers reuse keys and values earlier layers make"):
        effmem.apply_activation_policy(model, "min")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    effmem.apply_activation_policy(model, memory_budget=0.5)
    model(input_ids=x, labels=x).loss.backward()
    assert "min" not in budget_choice(model)["modes"]
    effmem.remove_activation_policy(model)
    effmem.apply_activation_policy(model, memory_budget=0.2)   # only "min" would meet it
    with pytest.raises(ValueError, match="'min' is left out: .*keys and values later layers share"):
        model(input_ids=x, labels=x)
