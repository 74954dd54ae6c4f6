"""Compatibility layers that let Megatron-Core run where it does not out of the box.

``megatron_diloco.compat.cpu``: Megatron-Core on CPU ranks over gloo (``cpu.apply()``).
"""
