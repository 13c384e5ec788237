"""Train an EAGLE-style feature head (``verispec.models.eagle``) for a native target.

    verispec train eagle --target smollm2 --extract-minutes 40 --minutes 60

Two phases. ``extract_features`` runs the target once over windows of the training split (chats in
the target's chat template, standard-library code, arithmetic; ``MixedTokenStream``) and caches each
window's token ids and final features (after the final norm, bf16: 1.15 KB a token for SmolLM2) as
shards on disk. ``train_eagle`` then trains the head over the cached shards for as many passes as its
budget allows, never running the target again: the target's distribution at each position is its LM
head applied to the cached feature.

The loss at each position, for each unrolled draft step s = 1..``recipe.unroll`` (training-time test:
step s feeds the head its own step s-1 predictions and attends as it will when drafting, to the true
pairs before the round and its own earlier steps; ``unrolled_attention_mask``):
cross-entropy of the target's distribution restricted to the first ``draft_vocab`` ids under the
head's, plus ``argmax_weight`` times the cross-entropy of the target's argmax there, plus
``feature_weight`` times the smooth-L1 distance of the predicted feature to the target's.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from verispec.models.eagle import EagleHead, save_eagle
from verispec.models.rope import apply_rotary
from verispec.train import corpus
from verispec.train.artifacts import plot_losses, write_json
from verispec.train.loop import BudgetedLoop, TrainHistory
from verispec.train.recipes import OptimConfig
from verispec.train.token_stream import DEFAULT_MIX, MixedTokenStream, WindowBatches

logger = logging.getLogger(__name__)

SHARD_WINDOWS = 64


@dataclass(frozen=True)
class EagleRecipe:
    draft_vocab: int = 8192
    unroll: int = 2
    argmax_weight: float = 0.5
    feature_weight: float = 1.0
    extract_batch: int = 8
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=20, seq_len=256, micro_batch=8, accum_steps=2,
                                     plan_after_steps=3, log_every=10, seed=5, weight_decay=0.0)
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))


# ---- phase 1: features ---------------------------------------------------------------------------------


@torch.inference_mode()
def target_features(target, windows: torch.Tensor) -> torch.Tensor:
    """The target's final features (B, T, H) float32, after the final norm, for windows (B, T)."""
    return target.model.norm(target.train_hidden(windows)[0])


def extract_features(target, encode, eos_id: int, render_chat, recipe: EagleRecipe, minutes: float,
                     cache_dir: str | Path, max_gb: float = 10.0) -> dict:
    """Append shards (``features-NNNNN.pt``: ``tokens`` (W, T+1) int32, ``features`` (W, T+1, H) bf16) to
    ``cache_dir`` for ``minutes`` of wall time or until ``max_gb`` are stored; resumes after the shards
    already there (a new seed per shard index, so no window repeats). With ``recipe.optim.precision``
    "bf16" the target runs under bfloat16 autocast (the features are stored in bf16 either way)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(cache_dir.glob("features-*.pt"))
    stream = MixedTokenStream(encode, eos_id, recipe.mix, split="train", seed=recipe.optim.seed + 1000 * len(existing),
                              render_chat=render_chat)
    batches = WindowBatches(stream, recipe.optim.seq_len, recipe.extract_batch, seed=recipe.optim.seed + len(existing))
    batches.prime()
    stored = sum(path.stat().st_size for path in existing)
    start, index, tokens_done = time.monotonic(), len(existing), 0
    progress = tqdm(desc="features", unit="tok", unit_scale=True, dynamic_ncols=True, mininterval=5.0,
                    total=None)
    while time.monotonic() - start < minutes * 60 and stored < max_gb * 1e9:
        token_rows, feature_rows = [], []
        while sum(len(rows) for rows in token_rows) < SHARD_WINDOWS and time.monotonic() - start < minutes * 60:
            windows = next(batches)
            token_rows.append(windows.to(torch.int32))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.optim.precision == "bf16"):
                feature_rows.append(target_features(target, windows).to(torch.bfloat16))
            tokens_done += windows.numel()
            progress.update(windows.numel())
        if not token_rows:
            break
        path = cache_dir / f"features-{index:05d}.pt"
        torch.save({"tokens": torch.cat(token_rows), "features": torch.cat(feature_rows)}, path)
        stored += path.stat().st_size
        index += 1
    progress.close()
    seconds = time.monotonic() - start
    summary = {"shards": index, "new_tokens": tokens_done, "seconds": seconds,
               "tokens_per_s": tokens_done / max(seconds, 1e-9), "bytes": stored, "stream": stream.stats()}
    logger.info("features: %d new tokens in %.0f s (%.0f tok/s); %d shards, %.2f GB", tokens_done, seconds,
                summary["tokens_per_s"], index, stored / 1e9)
    return summary


class ShardBatches:
    """Endless random batches (tokens (B, T+1) int64, features (B, T+1, H) float32) over cached shards,
    loaded into memory once (bf16)."""

    def __init__(self, cache_dir: str | Path, batch_size: int, seed: int):
        shards = [torch.load(path) for path in sorted(Path(cache_dir).glob("features-*.pt"))]
        if not shards:
            raise FileNotFoundError(f"no feature shards in {str(cache_dir)!r}; run the extraction first")
        self.tokens = torch.cat([shard["tokens"] for shard in shards])
        self.features = torch.cat([shard["features"] for shard in shards])
        self.batch_size, self._rng = batch_size, random.Random(seed)
        self._order: list[int] = []
        self.epochs = 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self._order) < self.batch_size:
            self._order = list(range(len(self)))
            self._rng.shuffle(self._order)
            self.epochs += 1
        rows = [self._order.pop() for _ in range(self.batch_size)]
        return self.tokens[rows].long(), self.features[rows].float()


# ---- phase 2: the head ---------------------------------------------------------------------------------


def unrolled_attention_mask(length: int, step: int) -> torch.Tensor:
    """Bool (T, step * T): which keys draft step ``step`` (1-based) at pair index j sees, keys ordered
    step 1's T pairs, then step 2's, ...: step 1's pairs 0 .. j - step + 1 (true features, committed
    before the round) and, for each earlier-or-own step r >= 2, step r's pair j - (step - r) (the
    round's drafts so far). Step 1 is plain causal attention."""
    j = torch.arange(length)[:, None]
    i = torch.arange(length)[None, :]
    parts = [i <= j - step + 1]
    for r in range(2, step + 1):
        parts.append(i == j - (step - r))
    return torch.cat(parts, dim=1)


def _layer_step(layer, x: torch.Tensor, cos, sin, past: list[tuple[torch.Tensor, torch.Tensor]],
                mask: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``DecoderLayer.forward`` for inputs x (B, T, H) attending to ``past`` steps' keys and values and
    its own under ``mask`` (T, (len(past) + 1) T); returns the output and this step's (k, v)."""
    attention = layer.self_attn
    heads, kv_heads, head_dim = attention.heads, attention.kv_heads, attention.head_dim
    batch, length, _ = x.shape
    normed = layer.input_layernorm(x)
    qkv = torch.cat([attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)], dim=-1)
    qkv = qkv.view(batch, length, heads + 2 * kv_heads, head_dim)
    qk = apply_rotary(qkv[:, :, :heads + kv_heads], cos, sin)
    q = qk[:, :, :heads].transpose(1, 2)
    k = qk[:, :, heads:].transpose(1, 2)
    v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
    keys = torch.cat([kv[0] for kv in past] + [k], dim=2)
    values = torch.cat([kv[1] for kv in past] + [v], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    x = x + attention.o_proj(out.transpose(1, 2).reshape(batch, length, heads * head_dim))
    return x + layer.mlp(layer.post_attention_layernorm(x)), (k, v)


def unrolled_predictions(head: EagleHead, features: torch.Tensor, next_tokens: torch.Tensor, steps: int
                         ) -> list[torch.Tensor]:
    """The head's normalised predicted features (B, T, H) for draft steps 1..``steps`` over windows:
    features (B, T, H) of positions 0..T-1 and the tokens (B, T) that followed them. Step s at pair j
    takes step s-1's prediction at pair j-1 (its guess at f_j) with token j+1 and attends as drafting
    does (``unrolled_attention_mask``): its entries j >= s-1 are what the drafter computes there."""
    body = head.body
    batch, length, _ = features.shape
    positions = torch.arange(length).expand(batch, length)
    cos, sin = body._rotary(positions)
    cos, sin = cos[:, :, None], sin[:, :, None]  # (B, T, 1, D): broadcast over heads after the view
    embeds = body.model.embed_tokens(next_tokens)
    layer = body.model.layers[0]
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    previous, out = features, []
    for step in range(1, steps + 1):
        if step > 1:
            previous = torch.cat([previous.new_zeros(batch, 1, previous.shape[-1]), previous[:, :-1]], dim=1)
        x = head.fc(torch.cat([previous, embeds], dim=-1))
        hidden, kv = _layer_step(layer, x, cos, sin, past, unrolled_attention_mask(length, step))
        past.append(kv)
        previous = body.model.norm(hidden)
        out.append(previous)
    return out


def eagle_loss(head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, recipe: EagleRecipe
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """The unrolled loss on windows: tokens (B, T+1), features (B, T+1, H) (the target's, normed)."""
    inputs, next_tokens, wanted = features[:, :-1], tokens[:, 1:], features[:, 1:]
    length = inputs.shape[1]
    with torch.no_grad():
        target_logits = head.draft_logits(wanted)  # (B, T, N): the target's scores of x_(t+2) over ids < N
        soft_target = F.softmax(target_logits, dim=-1)
        argmax = target_logits.argmax(-1)
    total = torch.zeros(())
    scalars: dict[str, float] = {}
    for step, predicted in enumerate(unrolled_predictions(head, inputs, next_tokens, recipe.unroll), start=1):
        valid = slice(step - 1, length)
        log_q = F.log_softmax(head.draft_logits(predicted[:, valid]), dim=-1)
        soft = -(soft_target[:, valid] * log_q).sum(-1).mean()
        hard = F.nll_loss(log_q.reshape(-1, log_q.shape[-1]), argmax[:, valid].reshape(-1))
        regression = F.smooth_l1_loss(predicted[:, valid], wanted[:, valid])
        total = total + soft + recipe.argmax_weight * hard + recipe.feature_weight * regression
        with torch.no_grad():
            scalars[f"match_{step}"] = (log_q.argmax(-1) == argmax[:, valid]).float().mean().item()
        scalars[f"ce_{step}"] = soft.item()
    return total / recipe.unroll, scalars


@torch.no_grad()
def evaluate_head(head: EagleHead, batches, count: int, recipe: EagleRecipe) -> dict[str, float]:
    """Greedy match per unrolled step on ``count`` batches (the head's argmax over its ids = the
    target's argmax there), as in training."""
    sums: dict[str, float] = {}
    for _ in range(count):
        tokens, features = next(batches)
        _, scalars = eagle_loss(head, tokens, features, recipe)
        for key, value in scalars.items():
            sums[key] = sums.get(key, 0.0) + value / count
    return sums


def train_eagle(recipe: EagleRecipe, minutes: float, extract_minutes: float, target_name: str,
                out_dir: str | Path, run_dir: str | Path, init_dir: str | Path | None = None) -> dict:
    """Extract features for ``extract_minutes`` (added to the cache in ``run_dir/features``), then train
    the head for ``minutes`` over the whole cache; write it to ``out_dir``."""
    from verispec.models.eagle import load_eagle
    from verispec.train.gguf_draft import load_teacher

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    teacher = load_teacher(target_name)
    target = teacher.model
    extraction = {}
    if extract_minutes > 0:
        extraction = extract_features(target, teacher.encode, teacher.eos_id, teacher.render, recipe, extract_minutes,
                                      run_dir / "features")
    torch.manual_seed(recipe.optim.seed)
    if init_dir is not None:
        head = load_eagle(init_dir, target, kernels=False)
        for parameter in (*head.body.model.layers.parameters(), *head.fc.parameters()):
            parameter.requires_grad_(True)
        head.train()
    else:
        head = EagleHead.for_target(target, recipe.draft_vocab)
    batches = ShardBatches(run_dir / "features", recipe.optim.micro_batch, recipe.optim.seed)
    logger.info("head: %d trainable parameters; %d cached windows (%d tokens)",
                sum(p.numel() for p in head.trainable_parameters()), len(batches),
                len(batches) * (recipe.optim.seq_len + 1))

    def loss_fn(batch, micro_step: int):
        return eagle_loss(head, *batch, recipe)

    def save_latest(step: int, history: TrainHistory) -> None:
        save_eagle(head, run_dir / "checkpoint-latest", target_name)
        write_json(run_dir / "history.json", {"records": history.records})

    history = TrainHistory()
    if minutes > 0:
        history = BudgetedLoop(head, recipe.optim, minutes, on_checkpoint=save_latest).run(batches, loss_fn)
    head.eval()
    heldout = {}
    for name in corpus.WORKLOADS:
        tokens = teacher.heldout_windows(name, 16, recipe.optim.seq_len)
        heldout[name] = evaluate_head(head, iter([(tokens, target_features(target, tokens).float())]), 1, recipe)
        logger.info("held-out %s: %s", name, heldout[name])
    metrics = {"recipe": asdict(recipe), "target": target_name,
               "parameters_trained": sum(p.numel() for p in head.trainable_parameters()),
               "extraction": extraction,
               "training": {"steps": history.steps_done, "tokens": history.tokens_seen,
                            "seconds": history.train_seconds, "cached_windows": len(batches),
                            "passes_begun": batches.epochs},
               "heldout_greedy_match": heldout}
    save_eagle(head, out_dir, target_name, {"verispec_training": {"heldout_greedy_match": heldout}})
    write_json(run_dir / "metrics.json", metrics)
    write_json(Path(out_dir) / "training_metrics.json", metrics)
    if history.records:
        plot_losses(history.records, ["loss"], run_dir / "loss.png", "EAGLE head loss")
    return metrics
