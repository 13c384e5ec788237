"""Shared fixtures: tiny random HF checkpoints written by transformers, loaded by the native loader."""

from __future__ import annotations

import os

import pytest
import torch

from verispec.testing import make_byte_tokenizer, make_checkpoint

torch.set_num_threads(int(os.environ.get("VERISPEC_TEST_THREADS", "1")))

VOCAB = 64


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> checkpoint dir. Targets: llama, qwen2 (qkv bias), llama_tied; drafts: small llama."""
    root = tmp_path_factory.mktemp("ckpt")
    specs = {
        "llama": dict(arch="llama", hidden=64, layers=2, seed=1),
        "qwen2": dict(arch="qwen2", hidden=64, layers=2, seed=2),
        "llama_tied": dict(arch="llama", hidden=64, layers=2, seed=3, tie=True),
        "draft": dict(arch="llama", hidden=32, layers=1, heads=2, kv_heads=1, seed=4),
        "draft_qwen2": dict(arch="qwen2", hidden=32, layers=1, heads=2, kv_heads=1, seed=5),
    }
    out = {}
    for name, spec in specs.items():
        out[name] = make_checkpoint(root / name, VOCAB, **spec)
    return out


@pytest.fixture(scope="session")
def byte_pair(tmp_path_factory):
    """A random target + draft with a byte-level tokenizer, for CLI tests."""
    root = tmp_path_factory.mktemp("pair")
    target, draft = root / "target", root / "draft"
    vocab = make_byte_tokenizer(target)
    make_byte_tokenizer(draft)
    make_checkpoint(target, vocab, hidden=64, layers=2, seed=7)
    make_checkpoint(draft, vocab, hidden=32, layers=1, heads=2, kv_heads=1, seed=8)
    return target, draft


@pytest.fixture(params=["amx", "avx512", "avx2"])
def kernel_path(request, monkeypatch):
    """Each multiply path of the kernel this CPU has: AMX tiles for bf16 weights ("amx"), the AVX-512
    loop ("avx512", AMX off) and the AVX2 loop ("avx2", both off, as on CPUs with neither). Weights are
    packed for the path when a model is accelerated, so build the model inside the test. A path this
    CPU lacks is skipped, with why."""
    from verispec import kernels

    if request.param == "amx" and not kernels.amx():
        pytest.skip(f"no AMX path here ({kernels._amx_reason or 'kernel unavailable'})")
    if request.param == "avx512" and not kernels.avx512():
        pytest.skip(f"no AVX-512 path here ({kernels._avx512_reason or 'kernel unavailable'})")
    if request.param != "amx":
        monkeypatch.setattr(kernels, "_amx_reason", "turned off by the test")
    if request.param == "avx2" and kernels.avx512():
        kernels.set_avx512(False)
        request.addfinalizer(lambda: kernels.set_avx512(True))
    return request.param

