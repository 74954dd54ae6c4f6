"""What the tests and the benchmarks share to run training jobs and measure inside them (not shipped:
``setup.py`` packages ``megatron_diloco`` only).

* :mod:`harness.run`: the one entry point that runs the example with named recorders attached
  (``python harness/run.py --record training --out DIR -- <example flags>``);
* :mod:`harness.recorders`: the recorders, one registry of short names (``training``, ``wan``, ...);
* :mod:`harness.runner`: the benchmarks' job runner (``Job``, ``Command``, ``run_jobs``);
* :mod:`harness.continued`: runs longer than one device call (checkpointed, stopped in time, the manifest);
* :mod:`harness.launch`: the tests' launcher (ranks forked from :mod:`harness.zygote`, or torchrun);
* :mod:`harness.federation`: separate replica jobs and a ``torchft_lighthouse`` (tests and benchmarks);
* :mod:`harness.link_model` (in-process slow link), :mod:`harness.netns` (network namespaces + ``tc``),
  :mod:`harness.gpu_bench` (the GPU benchmarks' model and readers).

Nothing here is used by training itself.
"""
