"""Compatibility layers that let Megatron-Core 0.19 run where it does not out of the box.

- ``compat.cpu``: Megatron-Core on CPU ranks over gloo (``cpu.apply()``; no-op when CUDA exists).
- ``compat.distopt_resume``: Megatron bugs that break resuming the distributed optimizer on
  torch's Adam (no TE/Apex) or in fp32, on any device (``distopt_resume.apply()``).
- ``compat.wheel``: a pip-installed megatron-core has prebuilt dataset helpers but no Makefile;
  skip the compile step that would ``sys.exit(1)`` (``wheel.apply()``, any device).

:func:`apply_all` applies each one that this process needs; call it before Megatron builds anything.
"""


def apply_all() -> None:
    """The CPU shim (only without CUDA), then the resume and wheel fixes (any device). Idempotent."""
    from megatron_diloco.compat import cpu, distopt_resume, wheel

    if cpu.cpu_mode():
        cpu.apply()
    distopt_resume.apply()
    wheel.apply()
