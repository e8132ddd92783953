"""The memory effmem.linear_cross_entropy (csrc/common/linear_ce.cpp) holds beyond what the trace sees: its
chunk buffers, and with grad_in_forward the float32 sum of the head's gradient."""


def fused_ce_buffers(tokens: int, vocab: int, hidden: int) -> int:
    """Backward buffers of effmem.linear_cross_entropy: one chunk's float32 logits and their gradient
    (chunk_size in csrc/common/linear_ce.cpp: 1/64 of the vocabulary in multiples of 128, at least 256,
    at most 128 MB of logits), and the float32 hidden gradient it sums into."""
    fit = (128 << 20) // (4 * max(tokens, 1))
    chunk = max(1, min(vocab, max(256, vocab // 64 // 128 * 128), fit // 128 * 128 if fit >= 128 else fit))
    return 2 * 4 * tokens * chunk + 4 * tokens * hidden


def fused_ce_gif_buffers(tokens: int, vocab: int, hidden: int, target: str) -> int:
    """What effmem.linear_cross_entropy(grad_in_forward=True) holds at the end of a bf16 model's forward
    beyond the gradients it keeps for backward (those the trace counts): the weight gradient's float32 sum
    (4 B per head element) while the bf16 gradient is made from it, or, during the chunks, that sum less the
    bf16 gradient not made yet, and one chunk's float32 logits and their gradient (bf16 on CUDA, float32 on
    the CPU), tb tokens wide (token_chunk_size in csrc/common/linear_ce.cpp). An H200 measured 2.45 GiB of
    extra peak at 16k tokens x 128k x 4096, where this gives 2.63 GB (2.45 GiB)."""
    tb = gif_token_chunk(tokens, vocab, hidden, target)
    chunk = tb * vocab * (4 + (2 if target == "cuda" else 4))
    return max(4 * vocab * hidden, 2 * vocab * hidden + chunk)


def gif_token_chunk(tokens: int, vocab: int, hidden: int, target: str) -> int:
    """Tokens per chunk of linear_cross_entropy(grad_in_forward=True) with token_chunk=0 (token_chunk_size in
    csrc/common/linear_ce.cpp): 1/32 of the tokens in multiples of 8, at least 128 on CUDA and 256 on the
    CPU, at most 128 MB of float32 logits; on CUDA, for the trained bf16 head planned, at least min(2048, H / 2)."""
    fit = max(8, (128 << 20) // (4 * max(vocab, 1)) // 8 * 8)
    tb = min(max(128 if target == "cuda" else 256, tokens // 32 // 8 * 8), fit)
    if target == "cuda":   # the float32 sum's traffic, not the products, would set the time of thin chunks
        tb = max(tb, min(2048, hidden // 2 // 8 * 8))
    return max(1, min(tokens, tb))
