"""The DiLoCoX algorithm on one rank's flat fp32 shard and explicit process groups.

Nothing here imports Megatron (``tests/test_layout.py`` keeps it so): the outer step (``outer``), where
the outer state lives (``outer_store``), the shard seen as one vector (``shard_view``), the exchange
(``collectives``: launch, completion, accounting), the codecs (``compression``), the round boundary
protocols (``sync``) and the hyperparameters (``config``). :mod:`megatron_diloco.megatron_adapter`
plugs them into Megatron-Core.
"""
