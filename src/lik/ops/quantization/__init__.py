"""Per-row symmetric 8-bit quantization (int8, float8 e4m3) of embeddings: a fused kernel and its reference."""

from .function import dequantize, quantize
from .reference import QUANTIZED_DTYPES, dequantize_reference, quantize_reference

__all__ = ["quantize", "dequantize", "quantize_reference", "dequantize_reference", "QUANTIZED_DTYPES"]
