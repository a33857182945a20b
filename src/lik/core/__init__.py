"""Pieces shared by the kernels of every op: launch budgets (``budget``), where sequences live (``segments``),
accumulation precision (``precision``), the 8-bit loader (``quantized``), NaN-propagating reductions
(``reductions``)."""
