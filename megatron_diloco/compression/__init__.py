"""Pseudo-gradient compression (DESIGN.md section 2)."""
