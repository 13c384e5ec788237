"""kernels/build.py: building and loading the kernel library, reported rather than raised where it fails
(disabled, no compiler), the build keyed by compiler and flags, and the load-time self-check per weight
path. The kernel's products: test_kernels.py."""

import os
import shutil

import pytest
import torch
from torch import nn

from verispec import kernels

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason=f"kernel unavailable here: {kernels.status()}")


def _weights(out_features, in_features, bf16_exact, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return weight.to(torch.bfloat16).float() if bf16_exact else weight


def test_disabled_by_environment(monkeypatch):
    kernels.library.cache_clear()
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    try:
        assert kernels.library() is None
        assert kernels.status() == "off (disabled by VERISPEC_KERNELS=0)"
        assert kernels.accelerate(nn.Linear(8, 8)) == 0
    finally:
        kernels.library.cache_clear()
        monkeypatch.delenv("VERISPEC_KERNELS")
    assert kernels.library() is not None


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    kernels.library.cache_clear()
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    try:
        assert kernels.library() is None
        assert kernels.status().startswith("off (build failed")
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()
    assert kernels.library() is not None


def test_a_path_failing_the_self_check_is_not_used(monkeypatch):
    """A weight path whose product disagrees with float64 at load is turned off, with why in status();
    its weights are packed for another path. fp32 failing leaves the library off."""
    real = kernels._product

    def wrong_for(*dtypes):
        return lambda lib, x, weight, bias, features: real(lib, x, weight, bias, features) + float(weight.dtype in dtypes)
    kernels.library.cache_clear()
    monkeypatch.setattr(kernels, "_product", wrong_for(torch.bfloat16, torch.int32))
    try:
        assert kernels.library() is not None
        assert set(kernels._failed) == {"bf16", "Q4_1"}
        assert "avx2: fp32, int8, Q8_0" in kernels.status()  # failing under AVX-512 too: AVX2 left
        assert "self-check turned off bf16 (off by up to 1" in kernels.status()
        monkeypatch.setattr(kernels, "_product", real)
        assert kernels._pack_weight(_weights(24, 64, True)).dtype == torch.float32
        generator = torch.Generator().manual_seed(0)
        for kind, dtype in (("Q4_1", torch.float32), ("Q8_0", torch.uint16)):
            raw = kernels._random_blocks(kind, 8, 64, generator)
            assert kernels._pack_weight(kernels.dequantize_blocks(kind, raw), (kind, raw)).dtype == dtype
        kernels.library.cache_clear()
        monkeypatch.setattr(kernels, "_product", wrong_for(torch.float32))
        assert kernels.library() is None
        assert kernels.status().startswith("off (self-check failed for fp32 weights (off by up to 1")
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()
    assert kernels.library() is not None and not kernels._failed


def test_the_build_is_keyed_by_the_compiler_and_flags(tmp_path, monkeypatch):
    """Another compiler (path or version) or other flags: another library file, never a stale build."""
    wrapper = tmp_path / "cc"
    wrapper.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "othercc 1.0"; exit 0; fi\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    system = os.environ.get("CC") or shutil.which("cc") or "gcc"
    assert kernels.library_path(system) == kernels.library_path(system)
    assert kernels.library_path(str(wrapper)) != kernels.library_path(system)
    assert kernels._compiler_identity(str(wrapper)) == f"{wrapper}\nothercc 1.0"
    before = kernels.library_path(system)
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-DVERISPEC_TEST"])
    assert kernels.library_path(system) != before
