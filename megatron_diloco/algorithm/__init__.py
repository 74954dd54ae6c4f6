"""The DiLoCoX algorithm on one rank's flat fp32 shard and explicit process groups.

Nothing here imports Megatron (``tests/test_layout.py`` keeps it so): the hyperparameters (``config``),
the round schedule (``schedule``), the shard seen as one vector (``shard_view``), the outer step
(``outer``), where the outer state lives (``outer_store``), one rank's outer state and its exchanges
(``sync``), the boundary protocols per overlap rule (``protocols``), the boundary's one decision
all-reduce (``decision``), the bounds on every wait across replicas (``bounds``), the exchange
(``exchange``: launch, completion, accounting), the link (``link``), the matrix codecs' worker thread
(``worker``) and the codecs (``compression``). :mod:`megatron_diloco.megatron_adapter` plugs them into
Megatron-Core.
"""
