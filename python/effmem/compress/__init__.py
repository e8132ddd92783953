"""Compressed saved activations: compress_activations and layers that save their input compressed.

    from effmem.compress import compress_activations
    model = compress_activations(model, bits=8)       # hooks on the module
    with compress_activations(bits=8) as ctx:         # or a block of code
        loss = model(x)
    print(ctx.stats.format())

Layout: api.py (entry points), hooks.py (the pack hook's rules; the dedup
store, strides and views, and the unpack hook are C++: csrc/saved/), policy.py
(what is kept as it is), tracker.py (the dispatch mode that finds exact
statistics), stats.py (CompressionStats), functions.py (compressed_linear /
compressed_gelu and their modules), _codec.py (the quantisation kernels).
"""
from effmem.compress.api import compress_activations, compressor_of, remove_compression
from effmem.compress.functions import CompressedGELU, CompressedLinear, compressed_gelu, compressed_linear
from effmem.compress.hooks import ActivationCompressor
from effmem.compress.policy import CompressConfig
from effmem.compress.stats import CompressionStats, Tally

__all__ = ["compress_activations", "remove_compression", "compressor_of", "ActivationCompressor",
           "CompressConfig", "CompressionStats", "Tally", "compressed_linear", "compressed_gelu",
           "CompressedLinear", "CompressedGELU"]
