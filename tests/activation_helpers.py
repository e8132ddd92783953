"""What the activation-policy tests share: a tiny Llama, learnable sequences, a short training run, memory after forward."""
import torch

import effmem
from effmem.plan.verify import bytes_in_use


# A tiny transformers Llama; tests override what their checks depend on (layers, widths).
LLAMA = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def tiny_llama(dtype=torch.float32, **overrides):
    """A random-init LlamaForCausalLM (seed 0, no download) in training mode, without a KV cache unless asked."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA, "use_cache": False, **overrides})
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def hf_checkpointing(model):
    """transformers' own per-layer checkpointing (non-reentrant), under its name in the installed version
    (transformers 5 renamed it; the old name warns)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def without_transformers_packed_check(monkeypatch):
    """For the no-host-sync tests: transformers' mask code asks the GPU whether a batch packs several sequences
    (masking_utils.find_packed_sequence_indices, a .all() read on the host) in every forward without a key/value
    cache, as training under any checkpointing runs. That sync is transformers', with or without effmem;
    answered as for an unpacked batch, set_sync_debug_mode("error") sees effmem's own syncs only."""
    from transformers import masking_utils
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def pattern(batch, seq, seed):
    """Sequences a model can learn: arithmetic progressions mod 256, random start and stride."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, 256, (batch, 1), generator=g), torch.randint(1, 8, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % 256


def outputs_of(model, x):
    """A training forward of a transformers causal LM or of the demo GPT: (everything it returned, loss)."""
    if hasattr(model, "config"):
        out = model(input_ids=x, labels=x)
        return out, out.loss
    out = model(x, x)
    return out, out[1]


def loss_of(model, x):
    return outputs_of(model, x)[1]


def train(model, steps=150, lr=1e-3):
    """Held-out loss after `steps` steps of FusedAdam on progressions (the same batches for every model)."""
    opt = effmem.FusedAdam(model.parameters(), lr=lr)
    for step in range(steps):
        loss_of(model, pattern(4, 64, seed=step)).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # held-out batches: less noisy than the last training losses
        return sum(loss_of(model, pattern(8, 64, seed=1000 + i)).item() for i in range(4)) / 4


def held_after_forward(model, x):
    """Allocator bytes a training forward leaves alive (glibc mallinfo2), the last of three steps."""
    for _ in range(3):  # the last of three: lazy allocations have settled
        model.zero_grad(set_to_none=True)
        before = bytes_in_use(torch.device("cpu"))
        out, loss = outputs_of(model, x)  # all of the output alive, as a training loop holds it (the logits)
        held = bytes_in_use(torch.device("cpu")) - before
        loss.backward()
        del out, loss
    return held
