"""Pseudo-gradient compression (docs/design.md, "Compression").

Modules, one concept each:

* :mod:`.reference`: the pure-torch blockwise codecs (int8/int4/fp8/int2) with error feedback: the spec.
* :mod:`.triton_kernels`: the fused encode/decode kernels matching it bit for bit.
* :mod:`.lowrank`: PowerSGD-style low-rank codec with a shared, warm-started basis.
* :mod:`.policy`: adaptive ranks from captured energy, and the per-round byte budget.
* :mod:`.codecs`: the codec objects behind ``--diloco-x-compression`` (:func:`get_codec`).
"""

from megatron_diloco.algorithm.compression.codecs import (
    AdaptiveCodec, BlockwiseCodec, RawCodec, get_codec, has_nonfinite,
)
from megatron_diloco.algorithm.compression.lowrank import LowRankCodec
from megatron_diloco.algorithm.compression.policy import AdaptivePolicy, byte_budget
from megatron_diloco.algorithm.compression.reference import has_nonfinite_scales, payload_layout

__all__ = [
    "AdaptiveCodec", "AdaptivePolicy", "BlockwiseCodec", "LowRankCodec", "RawCodec",
    "byte_budget", "get_codec", "has_nonfinite", "has_nonfinite_scales", "payload_layout",
]
