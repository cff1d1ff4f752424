"""Quantization-aware training gradient estimators (ste, clipped-ste, lsq, jacquant).

Not built yet; see DESIGN.md section 3.
"""
