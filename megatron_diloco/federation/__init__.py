"""Separate jobs per cluster that meet, fail, heal and rejoin (``--diloco-x-lighthouse``).

``membership``: which jobs are present at a boundary (torchft's lighthouse quorum, one torchft
``Manager`` per rank), the outer group over them, the commit of a round and the heal of a job that
is behind; ``handshake``: what every member must agree on (run name, flags, layout, data slot).
The boundary protocols that use them are the algorithm's (:mod:`megatron_diloco.algorithm.sync`);
this package holds everything that knows torchft.
"""
