"""GGUF files (llama.cpp's format) read into the native Llama model, through the ``gguf`` package.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")    # LlamaForCausalLM, kernels attached
    tokenizer = gguf_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")   # transformers tokenizer + chat template

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (the reader the llama.cpp project
maintains), so the model is exactly the file's dequantized weights. llama.cpp's converter permutes the
rows of the q and k projections (it pairs rotary halves differently); ``_unpermute_rows`` undoes that.
Linear layers stored in a block format the CPU kernel reads (Q4_1, Q8_0; Q4_0 and Q5_0 as Q8_0, Q4_K and
Q6_K repacked) also keep their raw rows as ``module.gguf_blocks = (type name, uint8 (N, row bytes))``: the
kernel then multiplies by the very same dequantized values while reading ~4.5-10 bits per weight instead of
32. Other formats (Q5_1, Q5_K, Q2_K, IQ*, ...) run as float32 weights. The tokenizer is rebuilt from
the file's metadata by transformers once; both conversions are cached beside the kernel build
(``kernels.cache_dir()``), keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from verispec.errors import CheckpointError
from verispec.models.checkpoint_io import weights_to_load
from verispec.models.llama import LlamaConfig, LlamaForCausalLM

SUPPORTED_ARCHITECTURES = ("llama",)
BLOCK_FORMATS = ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")  # kept as raw rows for the kernel (module docstring)

# GGUF tensor name (per layer, without "blk.N.") -> the native model's parameter name
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def _reader(path: str | Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf") from None
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as err:  # the reader raises ValueError, struct errors, IndexError on corrupt files
        raise CheckpointError(f"cannot read {str(path)!r} as a GGUF file ({type(err).__name__}: {err})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader) -> LlamaConfig:
    """The native model's config from a GGUF file's metadata (``llama.*`` keys)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    try:
        heads = int(_field(reader, f"{arch}.attention.head_count"))
        hidden = int(_field(reader, f"{arch}.embedding_length"))
        tokens = _field(reader, "tokenizer.ggml.tokens")
        vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
        eos = [int(_field(reader, "tokenizer.ggml.eos_token_id"))]
        if tokens and "<|endoftext|>" in tokens[:256]:  # ChatML models end documents with it too
            eos.append(tokens.index("<|endoftext|>"))
        names = {tensor.name for tensor in reader.tensors}
        return LlamaConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=sorted(set(eos)) if len(set(eos)) > 1 else eos[0],
            model_type="llama")
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"the GGUF metadata lacks or garbles a required {arch} key ({err})") from None


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: its converter stores, per head, the even
    rotary rows then the odd ones; HF's layout interleaves the two halves."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _tensors(reader, config: LlamaConfig) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor]]]:
    """(parameter name -> dequantized float32 tensor, linear module name -> (block format, raw rows))."""
    from gguf.quants import dequantize

    state, blocks = {}, {}
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _LAYER_TENSORS:
                raise CheckpointError(f"unexpected GGUF tensor {name!r} for a llama model")
            target = f"model.layers.{index}.{_LAYER_TENSORS[rest]}"
        elif name in _GLOBAL_TENSORS:
            target = _GLOBAL_TENSORS[name]
        elif name == "rope_freqs.weight":
            raise CheckpointError("GGUF files with rope frequency factors (llama 3.1 scaling) are not supported yet")
        else:
            raise CheckpointError(f"unexpected GGUF tensor {name!r} for a llama model")
        kind = tensor.tensor_type.name
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (the row) first
        values = values.reshape(shape)
        raw = np.asarray(tensor.data) if kind in BLOCK_FORMATS else None
        for suffix, heads in (("q_proj.weight", config.num_attention_heads), ("k_proj.weight", config.kv_heads)):
            if target.endswith(suffix):
                order = _unpermute_rows(values.shape[0], heads)
                values = values[order]
                raw = raw[order] if raw is not None else None
        state[target] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
        if raw is not None and values.ndim == 2:
            module = "lm_head" if target == "model.embed_tokens.weight" and config.tie_word_embeddings \
                else target.removesuffix(".weight")
            blocks[module] = (kind, torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)))
    return state, blocks


def load_gguf(path: str | Path, device: str = "cpu", kernels: bool = True) -> LlamaForCausalLM:
    """A Llama-architecture GGUF file as the native model (float32 dequantized weights; on the CPU the
    kernel reads the file's Q4_1 / Q8_0 rows directly where it can, see the module docstring)."""
    from verispec.kernels import accelerate

    config, state, blocks = _converted(Path(path))
    with torch.inference_mode(False):
        with weights_to_load():
            model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
        if missing or unexpected:
            raise CheckpointError(f"the tensors in {str(path)!r} do not match a {config.num_hidden_layers}-layer "
                                  f"llama model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model = model.to(device).eval()
        if device == "cpu":
            modules = dict(model.named_modules())
            for name, block in blocks.items():
                modules[name].gguf_blocks = block
        if kernels:
            accelerate(model)
    return model


def _cache_folder(path: Path, kind: str) -> Path:
    """A cache folder for what was derived from the file at ``path`` (keyed by its path, size and time)."""
    from verispec.kernels import cache_dir

    path = path.expanduser().resolve()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / kind / key


CONVERSION_VERSION = 1  # bump when _tensors changes what it produces


def _converted(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor]]]:
    """(config, dequantized state, block rows) of a GGUF file, converted once and cached as safetensors:
    parsing the metadata (every token string and merge) costs ~5-15 s, a cached copy loads in ~1 s."""
    from safetensors.torch import load_file, save_file

    folder = _cache_folder(path, "gguf")
    tensors, config_file = folder / "tensors.safetensors", folder / "config.json"
    if not (tensors.is_file() and config_file.is_file()):
        reader = _reader(path)
        config = gguf_config(reader)
        state, blocks = _tensors(reader, config)
        folder.mkdir(parents=True, exist_ok=True)
        flat = dict(state)
        for module, (kind, raw) in blocks.items():
            flat[f"blocks:{kind}:{module}"] = raw
        partial = folder / "tensors.safetensors.partial"
        save_file(flat, str(partial))
        partial.replace(tensors)
        config_file.write_text(json.dumps(config.to_hf_dict()))
    try:
        flat = load_file(str(tensors))
        config = LlamaConfig.from_hf_dict(json.loads(config_file.read_text()))
    except Exception as err:  # a cache damaged by hand or a full disk: convert again next time
        tensors.unlink(missing_ok=True)
        raise CheckpointError(f"the converted copy of {str(path)!r} in {folder} was unreadable ({err}); "
                              "it was removed, run the command again") from None
    state, blocks = {}, {}
    for name, tensor in flat.items():
        if name.startswith("blocks:"):
            _, kind, module = name.split(":", 2)
            blocks[module] = (kind, tensor)
        else:
            state[name] = tensor
    return config, state, blocks


def gguf_tokenizer(path: str | Path):
    """The file's tokenizer (and chat template) as a transformers tokenizer, converted once by
    transformers' own GGUF reader and cached as a tokenizer directory."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser().resolve()
    folder = _cache_folder(path, "tokenizers")
    if not (folder / "tokenizer.json").is_file():
        template = _field(_reader(path), "tokenizer.chat_template")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as err:  # transformers raises many types for what it cannot convert
            raise CheckpointError(f"cannot build a tokenizer from {str(path)!r}: {err}") from None
        if template:
            tokenizer.chat_template = template
        partial = folder.with_name(folder.name + ".partial")
        tokenizer.save_pretrained(str(partial))
        if not folder.exists():
            partial.replace(folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def round_to_q8_0(linears) -> int:
    """Round each of these nn.Linear layers (fp32, on the CPU, in_features % 32 == 0; a draft's own layers,
    never a target's) to GGUF Q8_0 blocks with ``gguf``'s quantizer: 32 weights share an fp16 scale, each
    an int8 multiple of it. The layer's weight becomes the blocks' dequantized values (in place) and
    ``gguf_blocks`` holds the rows, so the kernel multiplies 8.5 bits a weight (AMX tiles where present)
    and torch's path the same values: one draft on every path. Pack afterwards (``kernels.accelerate``).
    Returns the layers rounded."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from verispec.kernels.formats import dequantize_blocks

    rounded = 0
    for layer in linears:
        weight = layer.weight
        if weight.dtype != torch.float32 or weight.is_cuda or layer.in_features % 32:
            continue
        raw = torch.from_numpy(np.ascontiguousarray(quantize(weight.detach().numpy(), GGMLQuantizationType.Q8_0)))
        with torch.no_grad():
            weight.copy_(dequantize_blocks("Q8_0", raw))
        layer.gguf_blocks = ("Q8_0", raw)
        rounded += 1
    return rounded
