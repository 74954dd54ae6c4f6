"""The Megatron-Core adapter: what ties :mod:`megatron_diloco.algorithm` to Megatron's training loop.

``arguments`` (the ``--diloco-x*`` flags and their checks against Megatron's), ``integration``
(``install(args)``: wraps Megatron's training helpers), ``optimizer`` (``DiLoCoXOptimizer``: the
``MegatronOptimizer`` facade, parameter publishing), composed of ``checkpoint`` (``OuterCheckpoint``: the
DiLoCoX entries of its checkpoints), ``restart`` (``RestartPolicy``, ``LRSchedulePosition``: what a load
means for the outer loop), ``forwarding`` (``FORWARDED``: what it hands on to Megatron's optimizer) and
``shard_layout`` (``ShardLayout``: the world's shard table), ``topology`` (replica index and
process groups from Megatron's parallel state, or from separate launches), ``handshake`` (separate
launches compare their configurations), ``replica_local`` (Megatron's per-step collectives kept inside
a replica), ``sdpa_attention`` (the local layer spec with torch's SDPA as its core attention: the fast
path without Transformer Engine, not part of DiLoCoX).
"""
