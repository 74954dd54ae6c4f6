"""The Megatron-Core adapter: what ties :mod:`megatron_diloco.algorithm` to Megatron's training loop.

``arguments`` (the ``--diloco-x*`` flags and their checks against Megatron's), ``integration``
(``install(args)``: wraps Megatron's training helpers), ``optimizer`` (``DiLoCoXOptimizer``: the
``MegatronOptimizer`` facade, parameter publishing, checkpoints), ``topology`` (replica index and
process groups from Megatron's parallel state, or from separate launches), ``handshake`` (separate
launches compare their configurations), ``replica_local`` (Megatron's per-step collectives kept inside
a replica), ``sdpa_attention`` (the local layer spec with torch's SDPA as its core attention: the fast
path without Transformer Engine, not part of DiLoCoX).
"""
