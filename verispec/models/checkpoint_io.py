"""Checkpoint directories of the native models (config.json + *.safetensors): reading and writing them,
and loading a state dict into a model with a CheckpointError that names what does not fit."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from verispec.errors import CheckpointError


def read_config_json(path: Path) -> dict:
    """The config.json of checkpoint directory ``path``; a CheckpointError saying what is wrong and what
    to do when the directory, the file or its JSON object is missing or unreadable."""
    config_path = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist; pass a directory "
                              "holding config.json and *.safetensors")
    if not config_path.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json; is it an HF checkpoint directory?")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path} is not valid JSON ({err}); re-export the checkpoint") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {config_path}: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path} is not a JSON object; re-export the checkpoint")
    return raw


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``files`` (the shards of one checkpoint) in one state dict."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as err:  # safetensors raises several types for truncated/corrupt files
            raise CheckpointError(f"cannot read {file}: {err}") from None
    return state


def load_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> tuple[list[str], list[str]]:
    """``model.load_state_dict(state, strict=False)``, whose shape mismatches (weights that do not fit
    config.json) become one CheckpointError naming the first tensor."""
    try:
        return model.load_state_dict(state, strict=False)
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        reason = lines[0] if lines else (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(f"weights in {str(path)!r} do not fit its config.json: {reason.rstrip('.')}"
                              f"{f' (and {len(lines) - 1} more)' if len(lines) > 1 else ''}") from None


@contextmanager
def weights_to_load():
    """Modules built inside skip torch's random initialisation (``torch.nn.init``'s uniform, normal and
    Kaiming fills leave their tensors as allocated): a loader fills every parameter from the checkpoint
    right after, and ``load_all_weights`` refuses one it did not fill. SmolLM2's 211 linear layers
    spent 0.85 s (Zen 4) drawing weights that were overwritten. Not thread-safe: it swaps module
    functions, for the duration of a model's construction."""
    from torch.nn import init

    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_")
    saved = {name: getattr(init, name) for name in names}
    for name in names:
        setattr(init, name, _left_as_is)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


def _left_as_is(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def load_all_weights(model: nn.Module, state: dict[str, torch.Tensor], path: Path,
                     may_lack: frozenset[str] | set[str] = frozenset()) -> None:
    """``load_state``, then a CheckpointError unless every parameter outside ``may_lack`` (a tied LM
    head, an embedding supplied separately) was loaded and every tensor of ``state`` was used."""
    missing, unexpected = load_state(model, state, path)
    missing = [name for name in missing if name not in may_lack]
    if missing or unexpected:
        raise CheckpointError(f"weights in {str(path)!r} do not match its config.json: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")


def write_checkpoint(model: nn.Module, config_json: dict, out_dir: str | Path, dtype: torch.dtype,
                     tied: bool) -> None:
    """Write ``config_json`` (plus torch_dtype) as config.json and the model's state dict in ``dtype`` as
    model.safetensors into ``out_dir``; with ``tied`` the LM head, the embedding itself, is left out."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_json = {**config_json, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
