"""Numerical kernels shared by all compressors: selection, position coding, accounting."""
