"""Operator families: one package each, one file per variant, a pure-PyTorch reference beside the kernels."""
