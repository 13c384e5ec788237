"""A feature-level draft head (EAGLE-style) for a native Llama-family target.

The head sees what the target computed: at position t it takes the target's final hidden state f_t
(after the final norm, the vector the LM head reads) and the embedding of the token x_(t+1) that
followed, and predicts the target's next feature f_(t+1); the target's own LM head turns that into a
distribution over x_(t+2). Deeper drafts feed the head its own normalised prediction in place of f:

    x = fc([f_t ; embed(x_(t+1))])        (2H -> H, no bias)
    h = decoder_layer(x)                   (one Llama layer, its own KV cache, rotary position t)
    f'_(t+1) = norm(h)                     (the target's final norm, frozen)
    logits(x_(t+2)) = lm_head(f'_(t+1))    (the target's head, its first ``draft_vocab`` ids)

The layer lives in ``body``, a one-layer ``LlamaForCausalLM`` whose embedding, tied LM head and final
norm are the target's own tensors, so the native kernel runs the layer and the head as it does for a
draft model, and the head's checkpoint holds only ``fc`` and the layer (a shared-embedding checkpoint
plus ``eagle/fc.safetensors``; ``verispec_eagle: true`` in its config.json; the stored final norm is
the target's, replaced by the target's own module at load).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.models.checkpoint_io import weights_to_load
from verispec.models.llama import LlamaForCausalLM, load_checkpoint, save_checkpoint

EAGLE_KEY = "verispec_eagle"
FC_FILE = "eagle/fc.safetensors"  # beside, not among, the layer's *.safetensors


class EagleHead(nn.Module):
    def __init__(self, body: LlamaForCausalLM, draft_vocab: int):
        super().__init__()
        hidden = body.config.hidden_size
        self.body = body
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.draft_vocab = min(draft_vocab, body.config.vocab_size)

    @classmethod
    def for_target(cls, target: LlamaForCausalLM, draft_vocab: int, init_layer: int | None = None) -> "EagleHead":
        """A fresh head over ``target``: its layer a copy of the target's ``init_layer`` (default: the
        last, whose input is closest to a final feature), its fc the identity on the feature half."""
        config = replace(target.config, num_hidden_layers=1, tie_word_embeddings=True)
        body = LlamaForCausalLM(config)
        layer = target.config.num_hidden_layers - 1 if init_layer is None else init_layer
        body.model.layers[0].load_state_dict(target.model.layers[layer].state_dict())
        share_target_tensors(body, target)
        head = cls(body, draft_vocab)
        with torch.no_grad():
            hidden = config.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :hidden] = torch.eye(hidden)
            head.fc.weight[:, hidden:] = torch.eye(hidden)
        return head

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ---- training: whole sequences, no cache -------------------------------------------------------

    def train_features(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Predicted next features (B, T, H), normalised, for features (B, T, H) and the tokens (B, T)
        that followed each position: causal attention over the T positions."""
        body = self.body
        batch, length, _ = features.shape
        x = self.fc(torch.cat([features, body.model.embed_tokens(next_tokens)], dim=-1))
        positions = torch.arange(length, device=x.device).expand(batch, length)
        cos, sin = body._broadcast_rotary(*body._rotary(positions), batch, length)
        hidden = body.model.layers[0](x, cos, sin, None, 0, None, length)
        return body.model.norm(hidden)

    # ---- inference: pairs through the layer after a cache's rows ----------------------------------------

    def step(self, features: torch.Tensor, tokens: torch.Tensor, cache, tree_mask: torch.Tensor | None = None,
             depths: torch.Tensor | None = None, staged: int = 0) -> torch.Tensor:
        """Pairs (features (B, T, H), tokens (B, T)) through the layer after each row's length in ``cache``;
        normalised predicted features (B, T, H). Writes the pairs' KV there, uncommitted."""
        body = self.body
        x = self.fc(torch.cat([features, body.embed(tokens)], dim=-1))
        return body.model.norm(body.run_layers(x, cache, 0, 1, tree_mask, depths, staged))

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the first ``draft_vocab`` ids for normalised features (..., H)."""
        return F.linear(normed, self.body.lm_head.weight[:self.draft_vocab])


def share_target_tensors(body: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """The body's embedding, tied head and final norm become the target's (frozen), GGUF rows included."""
    body.model.embed_tokens.weight = target.model.embed_tokens.weight
    body.lm_head.weight = target.model.embed_tokens.weight if target.config.tie_word_embeddings \
        else target.lm_head.weight
    blocks = getattr(target.lm_head, "gguf_blocks", None)
    if blocks is not None:
        body.lm_head.gguf_blocks = blocks
    body.model.norm = target.model.norm
    for parameter in (body.model.embed_tokens.weight, body.lm_head.weight, *body.model.norm.parameters()):
        parameter.requires_grad_(False)


def is_eagle_dir(path: str | Path) -> bool:
    try:
        return bool(json.loads((Path(path) / "config.json").read_text()).get(EAGLE_KEY))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def save_eagle(head: EagleHead, out_dir: str | Path, target_name: str, extra: dict | None = None) -> None:
    """The layer (bf16, shared-embedding checkpoint) and fc (bf16) of ``head``; the target's tensors are
    not written."""
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    save_checkpoint(head.body, out_dir, dtype=torch.bfloat16)
    weights = load_file(str(out_dir / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # the final norm (576 values) stays
        weights.pop(name, None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / FC_FILE).parent.mkdir(exist_ok=True)
    save_file({"weight": head.fc.weight.detach().to(torch.bfloat16).contiguous()}, str(out_dir / FC_FILE),
              metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config.update({EAGLE_KEY: True, "verispec_shared_embedding": True, "verispec_draft_vocab": head.draft_vocab,
                   "verispec_target": target_name, **(extra or {})})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_eagle(path: str | Path, target: LlamaForCausalLM, kernels: bool = True, weights: str = "native") -> EagleHead:
    """A head saved by ``save_eagle``, over ``target``'s embedding, head and final norm; ``weights`` as
    ``for_inference``."""
    from safetensors.torch import load_file

    from verispec.errors import CheckpointError

    path = Path(path)
    if not is_eagle_dir(path):
        raise CheckpointError(f"{str(path)!r} is not a verispec EAGLE head (no '{EAGLE_KEY}' in its config.json)")
    config = json.loads((path / "config.json").read_text())
    if config.get("hidden_size") != target.config.hidden_size or config.get("vocab_size") != target.config.vocab_size:
        raise CheckpointError(f"the head in {str(path)!r} was made for hidden size {config.get('hidden_size')} and "
                              f"vocabulary {config.get('vocab_size')}; the target has {target.config.hidden_size} "
                              f"and {target.config.vocab_size}")
    device = str(target.lm_head.weight.device)
    body = load_checkpoint(path, device=device, kernels=False, shared_embedding=target.model.embed_tokens.weight)
    share_target_tensors(body, target)
    with weights_to_load():  # its fc, read next
        head = EagleHead(body, int(config.get("verispec_draft_vocab") or target.config.vocab_size))
    head.fc.weight.data = load_file(str(path / FC_FILE))["weight"].float().to(device)
    return for_inference(head, kernels, weights)


HEAD_WEIGHTS = ("q8_0", "int8", "native")  # how an inference head holds its own layers (``for_inference``)


def for_inference(head: EagleHead, kernels: bool = True, weights: str = "native") -> EagleHead:
    """``head`` frozen in eval mode, its linear layers on the native few-row kernel when ``kernels``.
    ``weights`` (HEAD_WEIGHTS): the layer's and fc's weights as saved (native, bf16), rounded to GGUF
    Q8_0 blocks (``round_to_q8_0``: 8.5 bits a weight on every path) or, on the kernel, int8 rows
    (``kernels.quantize``). A head only proposes: its weights move acceptance, never what is
    committed. The target's tensors it shares (embedding, LM head, norm) are never touched."""
    from verispec import kernels as native
    from verispec.models.gguf import round_to_q8_0

    if weights not in HEAD_WEIGHTS:
        raise ValueError(f"unknown head weights {weights!r}; choose one of {', '.join(HEAD_WEIGHTS)}")
    head.eval()
    for parameter in head.parameters():
        parameter.requires_grad_(False)
    own = [m for m in (*head.body.model.layers.modules(), head.fc) if isinstance(m, nn.Linear)]
    if weights == "q8_0":
        round_to_q8_0(own)
    if kernels:
        native.accelerate(head.body)
        native.accelerate(head.fc)
        if weights == "int8":
            native.quantize(head.body.model.layers)
            native.quantize(head.fc)
    return head
