"""verispec.bench.environment: model sizes and KV bytes per token from the config, peak-memory growth of a
unit of work, and the hardware / version facts a result records."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from verispec.bench.environment import (PeakMemory, describe_hardware, kv_bytes_per_token, model_facts,
                                        package_versions)


class _NativeLike(torch.nn.Module):
    """A native model's shape facts: 3 layers, 2 KV heads of dim 8, bfloat16 weights."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6, dtype=torch.bfloat16)  # 24 + 6 parameters, 2 bytes each
        self.config = SimpleNamespace(num_hidden_layers=3, kv_heads=2, dim_per_head=8, max_context=512)


def test_kv_bytes_per_token_of_a_native_model():
    assert kv_bytes_per_token(_NativeLike()) == 2 * 3 * 2 * 8 * 2  # keys and values x layers x heads x dim x bytes


def test_kv_bytes_per_token_of_a_transformers_adapter():
    inner = torch.nn.Linear(2, 2)  # float32: 4 bytes
    inner.config = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=8, hidden_size=64)
    adapter = SimpleNamespace(config=SimpleNamespace(), model=inner)
    assert kv_bytes_per_token(adapter) == 2 * 4 * 2 * (64 // 8) * 4  # head dim from hidden size / heads
    inner.config.head_dim = 16
    assert kv_bytes_per_token(adapter) == 2 * 4 * 2 * 16 * 4  # an explicit head_dim wins
    assert kv_bytes_per_token(SimpleNamespace(config=SimpleNamespace(), model=None)) is None


def test_model_facts_count_parameters_and_bytes(tmp_path):
    facts = model_facts(_NativeLike(), tmp_path)
    assert (facts["parameters"], facts["parameter_bytes"], facts["dtype"]) == (30, 60, "bfloat16")
    assert facts["dir"] == str(tmp_path) and facts["max_context"] == 512 and facts["kv_bytes_per_token"] == 192
    assert isinstance(facts["small_m_kernel"], str)


_PEAK_UNIT = """
from verispec.bench.environment import PeakMemory
memory = PeakMemory("cpu")
if not memory.can_reset_rss:
    print("unmeasurable")
else:
    memory.reset()
    block = b"\\x01" * (64 << 20)
    print(memory.peak_mb(), memory.method)
"""


def test_peak_memory_reports_growth_during_the_unit():
    # in a fresh process: in the suite's process, memory that other tests' threads and allocator arenas
    # hand back during the unit lowers the RSS under the mark and can hide the unit's growth (CI saw 0.0 MiB)
    # 64 MiB, every page written: above glibc's largest mmap threshold (32 MiB), so fresh pages
    done = subprocess.run([sys.executable, "-c", _PEAK_UNIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "unmeasurable":
        pytest.skip("this OS has no resettable peak-RSS counter (/proc/self/clear_refs)")
    grown, method = done.stdout.split(" ", 1)
    assert 60 <= float(grown) < 250 and "VmHWM" in method


def test_hardware_and_versions_name_what_the_result_depends_on():
    hardware = describe_hardware("cpu")
    assert hardware["torch_threads"] == torch.get_num_threads() and hardware["device"] == "cpu"
    assert hardware["logical_cores"] >= 1 and hardware["cpu_model"]
    versions = package_versions()
    assert versions["torch"] == str(torch.__version__)  # the installed distribution is the one imported
    assert versions["python"].count(".") == 2 and "verispec_git" in versions
