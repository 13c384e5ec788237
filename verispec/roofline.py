"""Plain decoding against its memory-bandwidth bound: a STREAM-like read-bandwidth probe, the bytes of
weights a decode step reads as the model stores them, and the roofline time those give (``verispec
profile`` reports decode time against it)."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def measure_bandwidth_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth, STREAM-like: the median time to sum a buffer far larger than the caches,
    with the threads torch uses now (GB/s, 1e9 bytes)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    buffer.sum()  # pages touched before timing
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(seconds) / 1e9


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer's weight as the kernel stores it
    (GGUF blocks, bf16, int8 or fp32; the tied LM head once), the norms, and one embedding row."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = getattr(module, "packed", None)
            weight = module.weight if weight is None else weight
            if weight.data_ptr() in seen:
                continue
            seen.add(weight.data_ptr())
            total += weight.numel() * weight.element_size()
        elif isinstance(module, nn.Embedding):
            total += module.weight.shape[1] * module.weight.element_size()
        elif hasattr(module, "weight") and isinstance(module.weight, torch.Tensor) and module.weight.dim() == 1:
            total += module.weight.numel() * module.weight.element_size()
    return total


def roofline(model: nn.Module, decode_ms: float, context: int) -> dict:
    """Plain decode time against its bandwidth bound: the bytes a step reads (weights as stored, plus the
    KV cache of ``context`` positions) over the measured read bandwidth."""
    bandwidth = measure_bandwidth_gb_s()
    config = model.config
    kv_bytes = 2 * config.num_hidden_layers * config.kv_heads * config.dim_per_head * context * 4
    weights = weight_bytes_per_token(model)
    bound_ms = (weights + kv_bytes) / (bandwidth * 1e9) * 1e3
    return {"bandwidth_gb_s": bandwidth, "weight_bytes_per_token": weights, "kv_bytes_per_token": kv_bytes,
            "roofline_ms": bound_ms, "decode_over_roofline": decode_ms / bound_ms}
