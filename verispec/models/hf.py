"""Adapter that lets any transformers causal LM (GPT-2, GPT-NeoX, OPT, Llama, ...) act as target or draft.

``HFModel`` keeps the native model's inference contract (``verispec/models/llama.py``): T new tokens per
row go right after the row's committed slots, at positions ``length - staged + depth``; an optional
tree mask says which of the round's own slots each new token sees. Its cache, ``HFCache``, offers the
``KVCache`` interface over transformers' own ``DynamicCache``, whose tensors the HF forward appends to:

    model = load_hf_checkpoint("gpt2-dir")
    cache = model.new_cache(1, 128)
    model.forward(torch.tensor([[5, 7, 9]]), cache, last_only=True)   # HF cache holds 3 entries
    cache.commit(0, 3)                                                # lengths == [3]
    model.forward(torch.tensor([[9, 4, 2]]), cache)                   # 6 entries, lengths == [3]
    cache.commit(0, 1)                                                # crop: 4 entries, lengths == [4]

Trees need the model to honour a custom 4-D attention mask and explicit position ids. Most
architectures in transformers 5 do (their mask builders return a 4-D mask unchanged); those that do
not are found by a small probe on first use and refused with a clear error. Early exit (running only
the first E layers) is native-only.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.cache import KVCache
from verispec.errors import CheckpointError, VerispecError
from verispec.models.llama import _attention_mask
from verispec.models.protocol import Capabilities

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048  # for architectures whose config names no maximum (ALiBi, ...)
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # kept as plain KV here


@dataclass(frozen=True)
class HFModelConfig:
    """The few config facts the engine, drafters and loader read (same names as ``LlamaConfig``)."""

    vocab_size: int  # the LM head's output size: the ids the model can score
    max_context: int
    eos_ids: list[int]
    num_hidden_layers: int
    model_type: str


class HFCache:
    """``KVCache``'s interface (lengths, max_len, check_room, commit, set_length, compact, reset) over a
    transformers ``DynamicCache``. The HF forward appends each pass's T entries; ``lengths`` says how
    many are committed, and the uncommitted tail is cropped as soon as every row agrees on a length
    (always, for one row). Rows must share one length when a forward runs."""

    def __init__(self, batch: int, max_len: int, layer_types: list[str] | None = None):
        self.hf = _dynamic_cache(layer_types)
        self.lengths = [0] * batch
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def written(self) -> int:
        """Entries the HF cache holds per row: committed ones plus the last pass's uncommitted tail."""
        return self.hf.get_seq_length()

    def check_room(self, num_new: int) -> None:
        KVCache.check_room(self, num_new)  # only reads lengths and max_len: one message for both caches

    def commit(self, row: int, num_new: int) -> None:
        """Make the first ``num_new`` entries written by the last pass part of row's prefix."""
        if self.lengths[row] + num_new > self.written:
            raise ValueError(f"cannot commit {num_new} entries: only {self.written - self.lengths[row]} "
                             "were written after the prefix")
        self.lengths[row] += num_new
        self._crop()

    def set_length(self, row: int, length: int) -> None:
        """Roll row back (or forward over entries still held) to ``length`` committed entries."""
        if not 0 <= length <= min(self.max_len, self.written):
            raise ValueError(f"length {length} outside [0, {min(self.max_len, self.written)}] (the HF cache "
                             f"holds {self.written} entries)")
        self.lengths[row] = length
        self._crop()

    @torch.inference_mode()  # the HF forward made these tensors in inference mode: edit them there too
    def compact(self, row: int, source_slots: list[int]) -> None:
        """Gather the KV at ``source_slots`` (absolute, ascending) into the slots after row's prefix
        and commit them: the accepted tree path, scattered over the flattened tree."""
        start = self.lengths[row]
        end = start + len(source_slots)
        if source_slots and source_slots != list(range(start, end)):
            for layer in self.hf.layers:
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    continue  # a KV-sharing layer, or one not reached yet
                index = torch.tensor(source_slots, device=layer.keys.device)
                layer.keys[row, :, start:end] = layer.keys[row].index_select(1, index)  # (Hkv, n, D)
                layer.values[row, :, start:end] = layer.values[row].index_select(1, index)
        self.lengths[row] = end
        self._crop()

    def reset(self) -> None:
        self.hf.reset()
        self.lengths = [0] * self.batch

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values (B, Hkv, S, D) per layer, S = ``written`` (for tests and inspection)."""
        return [(layer.keys, layer.values) for layer in self.hf.layers if getattr(layer, "keys", None) is not None]

    def prepare(self) -> int:
        """Drop any uncommitted tail before a pass; return the rows' shared committed length."""
        if len(set(self.lengths)) != 1:
            raise VerispecError("the transformers adapter needs every batch row at the same length; "
                                "run rows of different lengths one at a time")
        self._crop()
        return self.lengths[0]

    def _crop(self) -> None:
        keep = max(self.lengths)
        if self.written > keep:
            self.hf.crop(keep - self.written)  # a negative count removes that many trailing entries


class HFModel:
    """A transformers ``*ForCausalLM`` behind the native model's ``forward`` / ``new_cache`` contract."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        vocab = model.get_output_embeddings().weight.shape[0]
        self.config = HFModelConfig(vocab_size=vocab, max_context=_max_context(text),
                                    eos_ids=_eos_ids(model, vocab),
                                    num_hidden_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
                                    model_type=str(model.config.model_type))
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._takes_positions = "position_ids" in parameters
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        self._layer_types = _cache_layer_types(text, self.name)
        self._window = _attention_window(text, self._layer_types)
        self._tree_problem: str | None = None
        self._tree_probed = False

    @property
    def name(self) -> str:
        return self.config.model_type

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> HFCache:
        return HFCache(batch, max_len or self.config.max_context, self._layer_types)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: HFCache, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, last_only: bool = False,
                num_layers: int | None = None, staged: int = 0) -> torch.Tensor:
        """Logits (B, T, V) for T new tokens (B, T); same arguments as the native model's ``forward``
        (tree_mask (T, staged + T) or (B, T, staged + T); depths (T,) or (B, T))."""
        if num_layers is not None and num_layers != self.config.num_hidden_layers:
            raise VerispecError(f"early exit (running {num_layers} of {self.config.num_hidden_layers} layers) "
                                f"needs the native backend; model {self.name!r} is loaded through transformers")
        batch, num_new = tokens.shape
        cache.check_room(num_new)
        length = cache.prepare()
        tokens, mask, positions = tokens.to(self.device), None, None
        if tree_mask is not None or depths is not None or staged:
            self.check_trees()
            base = length - staged
            if depths is None:
                depths = torch.arange(staged, staged + num_new)
            positions = base + depths.to(self.device).expand(batch, num_new)  # (B, T)
            if tree_mask is not None:
                tree_mask = tree_mask.to(self.device)
            mask = _attention_mask([base] * batch, staged, num_new, length + num_new, tree_mask, self.device)
        logits = self._run(tokens, cache.hf, mask, positions, last_only)
        if cache.written != length + num_new:
            raise VerispecError(f"model {self.name!r} did not append its keys/values to the given cache "
                                f"({cache.written} entries, expected {length + num_new}); it cannot be used here")
        return logits

    def _run(self, tokens: torch.Tensor, hf_cache, mask: torch.Tensor | None, positions: torch.Tensor | None,
             last_only: bool) -> torch.Tensor:
        kwargs = {self._cache_kwarg: hf_cache, "use_cache": True}
        if mask is not None:  # (B, 1, T, S) bool -> additive float: works with eager and SDPA attention
            additive = torch.zeros(mask.shape, dtype=self.dtype, device=tokens.device)
            kwargs["attention_mask"] = additive.masked_fill(~mask, torch.finfo(self.dtype).min)
        if positions is not None:
            kwargs["position_ids"] = positions
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(input_ids=tokens, **kwargs).logits
        return logits[:, -1:] if last_only else logits

    @property
    def capabilities(self) -> Capabilities:
        """Trees (verified, and drafted level by level) where the model honours a 4-D mask and position
        ids (probed once: ``supports_trees``); nothing the native model's internals give."""
        return Capabilities(trees=self.supports_trees, staged_trees=self.supports_trees)

    # ---- tree support ------------------------------------------------------------------------------

    @property
    def supports_trees(self) -> bool:
        if not self._tree_probed:
            self._tree_problem = self._probe_trees()
            self._tree_probed = True
        return self._tree_problem is None

    @property
    def tree_problem(self) -> str | None:
        """Why this model cannot verify trees, or None (probed once)."""
        return None if self.supports_trees else self._tree_problem

    def check_trees(self) -> None:
        """Raise a VerispecError if this model cannot verify (or draft) trees."""
        if not self.supports_trees:
            raise VerispecError(f"model {self.name!r} cannot verify trees ({self._tree_problem}); "
                                "use --method chain")

    @torch.inference_mode()
    def _probe_trees(self) -> str | None:
        """Why trees fail, or None. Feeds a root a with two sibling children b, c (c must not see b,
        both at position 1) and compares c's logits with the plain chain [a, c]: a model that ignores
        the 4-D mask lets c see b, one that ignores position ids puts c at position 2."""
        if not self._takes_positions:
            return "its forward takes no position_ids"
        if self._window is not None and self._window < self.config.max_context:
            return (f"its sliding-window attention (window {self._window} < context {self.config.max_context}) "
                    "would be bypassed by a custom tree mask")
        vocab = self.config.vocab_size
        tokens = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=self.device)
        tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
        mask = tree.to(self.device)[None, None]  # (1, 1, 3, 3)
        positions = torch.tensor([[0, 1, 1]], device=self.device)
        try:
            tree_logits = self._run(tokens, _dynamic_cache(self._layer_types), mask, positions, False)[0, 2].float()
            chain_logits = self._run(tokens[:, [0, 2]], _dynamic_cache(self._layer_types), None, None,
                                     False)[0, 1].float()
        except Exception as err:  # noqa: BLE001 - any failure means the custom mask path is unusable
            reason = (str(err).strip().splitlines() or [""])[0]
            return f"a forward with a 4-D attention mask failed: {type(err).__name__}: {reason}"
        scale = float(chain_logits.abs().max()) + 1.0
        tolerance = (1e-4 if self.dtype == torch.float32 else 3e-2) * scale
        if float((tree_logits - chain_logits).abs().max()) > tolerance:
            return "it ignores custom 4-D attention masks or explicit position ids"
        return None


# ---- config facts -----------------------------------------------------------------------------------

def _max_context(text_config) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    log.warning("config names no maximum context; assuming %d positions", DEFAULT_CONTEXT)
    return DEFAULT_CONTEXT


def _attention_window(text_config, layer_types: list[str] | None) -> int | None:
    """The smallest local-attention window, or None when every layer attends to the whole context."""
    windows = []
    if layer_types is None or any(t in ("sliding_attention", "chunked_attention") for t in layer_types):
        for name in ("sliding_window", "attention_chunk_size"):
            value = getattr(text_config, name, None)
            if isinstance(value, int) and value > 0:
                windows.append(value)
    if "local" in str(getattr(text_config, "attention_layers", "")):  # GPT-Neo's local layers
        windows.append(int(text_config.window_size))
    return min(windows) if windows else None


def _cache_layer_types(text_config, name: str) -> list[str] | None:
    """transformers' per-layer cache types; refuse models whose state is not a plain KV cache."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        layer_types = list(get_layer_types_and_kwargs(text_config)[0])
    except Exception:  # noqa: BLE001 - older/other versions: let DynamicCache grow plain layers
        return None
    other = sorted(set(layer_types) - set(KV_LAYER_TYPES) - {"dummy"})
    if other:
        raise CheckpointError(f"model {name!r} keeps {', '.join(other)} state, which cannot be rolled back to a "
                              "committed prefix; speculative decoding here needs a key/value-cache transformer")
    return layer_types


def _dynamic_cache(layer_types: list[str] | None):
    """A DynamicCache whose attention layers are all plain DynamicLayers (they keep every entry, so a
    crop undoes any append; a sliding-window layer would drop history a rollback may need). The
    model still applies its windows through its masks."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if layer_types is not None and "dummy" in layer_types:  # KV-sharing layers store nothing
        from transformers.cache_utils import DummyLayer, DynamicLayer

        cache.layers = [DummyLayer() if t == "dummy" else DynamicLayer() for t in layer_types]
        cache.layer_class_to_replicate = None
    return cache


def _eos_ids(model: torch.nn.Module, vocab: int) -> list[int]:
    ids = getattr(model.config, "eos_token_id", None)
    if ids is None and getattr(model, "generation_config", None) is not None:
        ids = model.generation_config.eos_token_id
    ids = [] if ids is None else (list(ids) if isinstance(ids, (list, tuple)) else [ids])
    return [int(i) for i in ids if 0 <= int(i) < vocab]  # an id the head cannot score never ends a reply


# ---- checkpoints ------------------------------------------------------------------------------------

def load_hf_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> HFModel:
    """Load an HF checkpoint directory of any causal-LM architecture transformers knows (local files
    only, safetensors only, no remote code), or a GGUF file transformers can dequantize."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if path.suffix.lower() == ".gguf":  # transformers' own GGUF reading: the peer baseline for a GGUF target
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        except Exception as err:  # transformers raises many types for what it cannot read
            reason = (str(err).strip().splitlines() or [""])[0]
            raise CheckpointError(f"transformers cannot load {str(path)!r}: {type(err).__name__}: {reason}") from None
        return HFModel(model.to(device))
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{str(path)!r} has no config.json; is it an HF checkpoint directory?")
    try:
        raw = json.loads(config_path.read_text())
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, AttributeError) as err:
        raise CheckpointError(f"{config_path} is not a valid JSON object ({err}); re-export the checkpoint") from None
    if "auto_map" in raw:
        raise CheckpointError(f"{str(path)!r} needs custom modelling code (auto_map in config.json), which verispec "
                              "does not run; use an architecture built into transformers")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # unknown model_type raises ValueError/KeyError depending on the version
        raise CheckpointError(f"transformers does not know model_type {model_type!r} in {config_path} "
                              f"({type(err).__name__}); upgrade transformers or convert the checkpoint") from None
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise CheckpointError(f"model_type {model_type!r} in {str(path)!r} is not a causal language model "
                              "transformers can generate with; pass a decoder-only checkpoint") from None
    if not sorted(path.glob("*.safetensors")):
        raise CheckpointError(f"{str(path)!r} holds no *.safetensors weights (PyTorch .bin files are not "
                              "loaded for safety; convert them with transformers' save_pretrained)")
    try:
        model = model_class.from_pretrained(str(path), config=config, local_files_only=True,
                                            use_safetensors=True, dtype=dtype)
    except Exception as err:  # truncated / mismatched weights
        reason = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(f"cannot load the weights in {str(path)!r}: {type(err).__name__}: {reason}") from None
    return HFModel(model.to(device))
