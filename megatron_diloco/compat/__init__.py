"""Compatibility layers that let Megatron-Core 0.19 run where it does not out of the box.

- ``compat.cpu``: Megatron-Core on CPU ranks over gloo (``cpu.apply()``; no-op when CUDA exists).
- ``compat.distopt_resume``: Megatron bugs that break resuming the distributed optimizer on
  torch's Adam (no TE/Apex) or in fp32, on any device (``distopt_resume.apply()``).
"""
