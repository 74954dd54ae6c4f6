"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for Megatron-Core's
local layer spec: the fast path without Transformer Engine.

Megatron-Core 0.19's local spec computes attention with ``DotProductAttention``
(``megatron/core/transformer/dot_product_attention.py``): a ``baddbmm`` into a [b, np, sq, sk]
score tensor, a masked softmax (in fp32 for bf16 inputs), dropout and a ``bmm``. The score tensor
is read and written several times per layer, which makes attention memory-bound on a GPU.
:class:`SDPADotProductAttention` takes the same constructor and ``forward`` arguments and returns
the same [sq, b, np * hn] tensor, computed by torch's SDPA: FlashAttention-2 or the
memory-efficient kernel on CUDA (the scores never reach device memory), a fused kernel or the
math path on CPU.

Swapped in through the spec, the one seam Megatron offers for it (no subclassing, no patching)::

    from megatron_diloco.megatron_adapter.sdpa_attention import get_gpt_layer_sdpa_spec
    GPTModel(config, transformer_layer_spec=get_gpt_layer_sdpa_spec(normalization="RMSNorm"), ...)

``examples/pretrain_gpt_diloco.py --attention-sdpa`` does exactly this.

What it honours of ``DotProductAttention``'s interface:

* query / key / value in [s, b, heads, hn]; grouped-query attention (``--group-query-attention``:
  key / value with ng < np heads, head i of the query reading group i // (np / ng), as
  ``repeat_interleave`` does in the local module) through SDPA's ``enable_gqa``, without repeating
  key and value in memory;
* the softmax scale: ``softmax_scale`` or 1 / sqrt(hn). ``apply_query_key_layer_scaling`` divides
  the scores by the layer number and the fp32 softmax multiplies them back in the local module, a
  guard for fp16 overflow; the net scale is unchanged and SDPA applies it once;
* attention dropout (``attention_dropout`` or ``config.attention_dropout``), in training mode only,
  drawn inside Megatron's model-parallel RNG tracker as the local module draws it (the draws
  differ from the local module's: equal in distribution, not bit for bit);
* masks by ``attn_mask_type``. ``causal``: SDPA's own causal mask (``is_causal``, what lets the
  flash kernel run); a given ``attention_mask`` is not read, as in Megatron's fused causal softmax
  and Transformer Engine's attention, so it must be the plain causal mask (a data loader's
  ``--reset-attention-mask`` document masks are not: the example refuses that flag). With sq == 1
  (one decoded token) no mask, as the local module. ``padding`` / ``arbitrary`` /
  ``padding_causal``: the given boolean mask (True = masked out, broadcastable to [b, np, sq, sk]),
  or none when it is None, as the local module's unfused softmax does; ``no_mask``: none.
  Masked scores get -inf where the local module writes -10000: equal except for a row whose every
  key is masked (the local module then averages all values; SDPA returns NaN).

What it refuses, with a ``ValueError`` naming the Megatron flag: context parallelism, sliding
windows, softmax types other than ``vanilla``; in ``forward``, packed sequences and an attention
bias (as the local module asserts).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

#: Mask types whose ``attention_mask`` argument is used as given (None: no mask).
_GIVEN_MASK = (AttnMaskType.padding, AttnMaskType.arbitrary, AttnMaskType.padding_causal)


def check_supported(config: TransformerConfig, layer_number: int) -> None:
    """Raise ``ValueError`` (naming the Megatron flag) for a configuration this module cannot run."""
    if config.context_parallel_size != 1:
        raise ValueError("SDPA core attention does not support context parallelism "
                         f"(--context-parallel-size {config.context_parallel_size}); use 1")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise ValueError(f"SDPA core attention does not support sliding windows (--window-size {config.window_size})")
    if config.softmax_type != "vanilla":
        raise ValueError(f"SDPA core attention supports only --softmax-type vanilla, not {config.softmax_type!r}")


def check_args(args: Any, flag: str) -> None:
    """Refuse, before anything is built, Megatron arguments (the ``parse_and_validate_args``
    namespace) that ``flag`` (the option that selects this module) cannot honour: a
    ``ValueError`` naming ``flag`` and the conflicting flag."""
    conflicts = [
        (args.transformer_impl != "local", f"--transformer-impl {args.transformer_impl} "
         "(it replaces the local spec's core attention; Transformer Engine brings its own: use local)"),
        (args.context_parallel_size != 1, f"--context-parallel-size {args.context_parallel_size}"),
        (bool(getattr(args, "reset_attention_mask", False)),
         "--reset-attention-mask (document masks; it computes plain causal attention)"),
        (getattr(args, "window_size", None) is not None, f"--window-size {getattr(args, 'window_size', None)}"),
        (getattr(args, "softmax_type", "vanilla") != "vanilla", f"--softmax-type {getattr(args, 'softmax_type', None)}"),
        (bool(getattr(args, "multi_latent_attention", False)), "--multi-latent-attention"),
    ]
    bad = [what for hit, what in conflicts if hit]
    if bad:
        raise ValueError(f"{flag} does not support {'; '.join(bad)}")


class SDPADotProductAttention(MegatronModule):
    """``DotProductAttention``'s interface on ``torch.nn.functional.scaled_dot_product_attention``.

    Constructor arguments are those Megatron's ``SelfAttention`` passes to a ``core_attention``
    (``CoreAttentionBuilder`` in ``megatron/core/transformer/attention.py``). No parameters, no
    buffers: a checkpoint written with the local module loads with this one and back.

    Args:
        config: the transformer config (heads, groups, kv_channels, dropout, precision).
        layer_number: 1-based layer index (used by ``apply_query_key_layer_scaling`` and windows).
        attn_mask_type: the default mask type when ``forward`` gets none.
        attention_type: ``"self"`` or ``"cross"``; unused, as in the local module.
        attention_dropout: dropout probability on the attention weights; None: the config's.
        softmax_scale: multiplies q k^T; None: 1 / sqrt(hn).
        cp_comm_type: context-parallel communication; unused (context parallelism is refused).
        pg_collection: process groups; its ``tp`` group splits the heads (None: Megatron's
            ``parallel_state``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        check_supported(config, self.layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        # The local module divides by the layer number here and multiplies back in its fp32
        # softmax (apply_query_key_layer_scaling): the product is this scale.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attention of ``query`` over ``key`` / ``value``; inputs are not modified.

        Args:
            query: [sq, b, np, hn], bf16 / fp16 / fp32 (np: heads of this tensor-parallel rank).
            key: [sk, b, ng, hn], same dtype and device; ng divides np (ng < np: grouped queries).
            value: [sk, b, ng, hn].
            attention_mask: bool, True where a score is masked out, broadcastable to
                [b, np, sq, sk]; read only for the ``padding`` / ``arbitrary`` /
                ``padding_causal`` mask types (see the module docstring).
            attn_mask_type: overrides the constructor's mask type for this call.
            attention_bias: must be None (unsupported, as in the local module).
            packed_seq_params: must be None (unsupported, as in the local module).

        Returns:
            [sq, b, np * hn], the dtype of ``query``, contiguous.
        """
        if packed_seq_params is not None:
            raise ValueError("SDPA core attention does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("SDPA core attention does not support an attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        mask, causal = None, False
        if mask_type == AttnMaskType.causal:
            if sq == sk:
                causal = True
            elif sq != 1:
                raise ValueError(f"causal attention needs as many queries as keys (sq {sq}, sk {sk})")
        elif mask_type in _GIVEN_MASK and attention_mask is not None:
            mask = ~attention_mask  # SDPA's boolean mask: True = attend
        elif mask_type not in (*_GIVEN_MASK, AttnMaskType.no_mask):
            raise ValueError(f"SDPA core attention does not support attn_mask_type {mask_type.name}")

        # [s, b, heads, hn] -> [b, heads, s, hn] (views: SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs: dict[str, Any] = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                      scale=self.softmax_scale)
        if self.num_query_groups_per_partition != self.num_attention_heads_per_partition:
            kwargs["enable_gqa"] = True
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # the tensor-parallel ranks' heads differ: draw from the model-parallel RNG state
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def get_gpt_layer_sdpa_spec(**kwargs: Any) -> ModuleSpec:
    """Megatron-Core's local GPT layer spec (``get_gpt_layer_local_spec(**kwargs)``) with
    :class:`SDPADotProductAttention` as ``self_attention.submodules.core_attention``.

    Raises ``ValueError`` for multi-latent attention (its own attention module, not this one)."""
    if kwargs.get("multi_latent_attention"):
        raise ValueError("SDPA core attention does not support --multi-latent-attention")
    spec = get_gpt_layer_local_spec(**kwargs)
    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec
