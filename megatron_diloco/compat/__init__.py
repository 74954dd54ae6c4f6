"""Compatibility layers that let Megatron-Core 0.19 run where it does not out of the box.

- ``compat.cpu``: Megatron-Core on CPU ranks over gloo (``cpu.apply()``; no-op when CUDA exists).
- ``compat.distopt_resume``: Megatron bugs that break resuming the distributed optimizer on
  torch's Adam (no TE/Apex) or in fp32, on any device (``distopt_resume.apply()``).
- ``compat.distopt_sgd``: torch SGD under Megatron's distributed optimizer, which asserts without
  an ``init_state_fn`` (``distopt_sgd.apply()``; also applied by ``install()`` for ``--optimizer sgd``).
- ``compat.help``: ``--help`` on Megatron's parser, whose megatron-core 0.19.2 help strings include one
  that argparse cannot format (``escape_unformattable_help``, called by ``add_diloco_x_args``).
- ``compat.wheel``: a pip-installed megatron-core has prebuilt dataset helpers but no Makefile;
  skip the compile step that would ``sys.exit(1)`` (``wheel.apply()``, any device).

:func:`apply_all` applies each one that this process needs; call it before Megatron builds anything.
"""


def apply_all() -> None:
    """The CPU shim (only without CUDA), then the resume, SGD and wheel fixes (any device). Idempotent."""
    from megatron_diloco.compat import cpu, distopt_resume, distopt_sgd, wheel

    if cpu.cpu_mode():
        cpu.apply()
    distopt_resume.apply()
    distopt_sgd.apply()
    wheel.apply()
