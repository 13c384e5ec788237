"""What a result depends on besides the config: hardware, package versions, model sizes, memory.

    describe_hardware()   # {"cpu_model": "...", "logical_cores": 2, "torch_threads": 1, ...}
    package_versions()    # {"python": "3.11.7", "torch": "2.13.0", "transformers": ..., "verispec": ...}

Peak memory on the CPU: Linux lets a process reset its own peak-RSS mark (``VmHWM``) to the current RSS
by writing 5 to ``/proc/self/clear_refs``; ``PeakMemory`` does so before a measured unit of work and
reports how far the mark rose above the RSS at the reset: memory the unit needed beyond what the process
already held (allocator caches reused from earlier units do not show). On CUDA it uses the
``torch.cuda`` allocation counters the same way.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "verispec", "openai", "matplotlib")


def describe_hardware(device: str = "cpu") -> dict:
    info = {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "memory_gb": _meminfo_gb(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": device,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["verispec_git"] = _git_revision()
    return versions


def model_facts(model, directory: Path | None) -> dict:
    """Parameter bytes and per-token KV bytes of a native or transformers-adapter model."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    parameters = list(module.parameters()) if module is not None else []
    facts = {
        "dir": str(directory) if directory is not None else None,
        "parameters": sum(p.numel() for p in parameters),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in parameters),
        "dtype": str(parameters[0].dtype).removeprefix("torch.") if parameters else None,
        "kv_bytes_per_token": kv_bytes_per_token(model),
        "max_context": getattr(model.config, "max_context", None),
    }
    if module is not None:
        from verispec import kernels

        facts["small_m_kernel"] = kernels.status(module)
    return facts


def kv_bytes_per_token(model) -> int | None:
    """2 (keys, values) x layers x KV heads x head dim x bytes per element; None if unknown."""
    config = model.config
    if hasattr(config, "kv_heads") and hasattr(config, "dim_per_head"):
        layers, heads, dim = config.num_hidden_layers, config.kv_heads, config.dim_per_head
        size = next(model.parameters()).element_size()
        return 2 * layers * heads * dim * size
    hf_config = getattr(getattr(model, "model", None), "config", None)
    if hf_config is None:
        return None
    heads = getattr(hf_config, "num_key_value_heads", None) or getattr(hf_config, "num_attention_heads", None)
    hidden = getattr(hf_config, "hidden_size", None)
    attention_heads = getattr(hf_config, "num_attention_heads", None)
    if not (heads and hidden and attention_heads):
        return None
    dim = getattr(hf_config, "head_dim", None) or hidden // attention_heads
    size = next(model.model.parameters()).element_size()
    return 2 * hf_config.num_hidden_layers * heads * dim * size


class PeakMemory:
    """Peak memory growth of a unit of work: ``reset()`` before, ``peak_mb()`` after (None if
    unmeasurable)."""

    def __init__(self, device: str = "cpu"):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.can_reset_rss = _can_reset_rss()
        self.baseline_kb = 0

    @property
    def method(self) -> str:
        if self.cuda:
            return "growth of torch.cuda.max_memory_allocated over the allocation at the unit's start"
        if self.can_reset_rss:
            return ("growth of the process peak RSS (VmHWM, reset via /proc/self/clear_refs) over its RSS at the "
                    "unit's start")
        return "unavailable (no resettable peak-RSS counter on this OS)"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.baseline_kb = torch.cuda.memory_allocated() // 1024
        elif self.can_reset_rss:
            _reset_rss_peak()
            self.baseline_kb = _status_kb("VmRSS")

    def peak_mb(self) -> float | None:
        if self.cuda:
            return (torch.cuda.max_memory_allocated() // 1024 - self.baseline_kb) / 1024
        if self.can_reset_rss:
            return max(0, _status_kb("VmHWM") - self.baseline_kb) / 1024
        return None


def process_peak_rss_mb() -> float | None:
    """Peak RSS since the last reset (or process start); None where /proc is missing."""
    kb = _status_kb("VmHWM")
    return kb / 1024 if kb else None


def _can_reset_rss() -> bool:
    try:
        _reset_rss_peak()
        return _status_kb("VmHWM") > 0
    except OSError:
        return False


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _status_kb(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'-dirty' if dirty else ''}" if head else None
