"""Distil a draft for a GGUF target (SmolLM2-135M-Instruct by default) that shares the target's embedding.

    metrics = train_gguf_draft(GgufDraftRecipe(), minutes=60, target="smollm2",
                               out_dir="verispec/data/smollm2-draft", run_dir="runs/smollm2-draft")

The draft is the target's first layers (``recipe.layers``), then the target's final norm and tied LM
head, fine-tuned by distillation on the target's own distributions over the training split of the
three workloads (chats rendered in the target's chat template, standard-library code, arithmetic).
Only the draft's layers and final norm are trained and shipped; the embedding and LM head are the
target's, shared at load time (``"verispec_shared_embedding": true`` in the draft's config.json), so the
draft costs no bytes of the package for them. The draft scores only the first ``recipe.draft_vocab``
token ids (BPE ids are roughly in frequency order: on held-out code and arithmetic 91% of SmolLM2's
greedy tokens have ids below 8192, 97% below 16384), so the loss is the cross-entropy of the target's
distribution restricted to those ids (the softmax of the target's logits for them), plus a
cross-entropy on the target's most likely id among them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.models.llama import LlamaForCausalLM, parameter_count, save_checkpoint
from verispec.train import corpus
from verispec.train.artifacts import plot_losses, write_json
from verispec.train.loop import BudgetedLoop, TrainHistory
from verispec.train.recipes import EvalConfig, OptimConfig
from verispec.train.token_stream import DEFAULT_MIX, MixedTokenStream, WindowBatches

logger = logging.getLogger(__name__)

SHARED_EMBEDDING_KEY = "verispec_shared_embedding"


@dataclass(frozen=True)
class GgufDraftRecipe:
    """The draft starts as the target's layers ``layers`` (in that order) and learns to score the first
    ``draft_vocab`` ids; ``argmax_weight`` weighs the extra cross-entropy on the target's argmax."""

    layers: tuple[int, ...] = (0, 1)
    draft_vocab: int = 16384
    argmax_weight: float = 0.5
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=10, seq_len=256, micro_batch=8, accum_steps=2,
                                     plan_after_steps=3, log_every=5, seed=3)
    eval: EvalConfig = EvalConfig(windows_per_workload=16, micro_batch=8)
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))


@dataclass(frozen=True)
class Teacher:
    """A target loaded for training against (frozen, torch's path) with what its text needs: ids for
    documents, the end-of-document id, and chats in its own template (None: the embedded format)."""

    model: LlamaForCausalLM
    tokenizer: object
    eos_id: int
    render: object

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def heldout_windows(self, name: str, windows: int, seq_len: int) -> torch.Tensor:
        """Up to ``windows`` windows (W, seq_len + 1) of the held-out split of one workload (its first 64
        documents, each followed by the end-of-document id)."""
        ids: list[int] = []
        for text in corpus.load_workload(name, "heldout", self.render)[:64]:
            ids.extend(self.encode([text])[0] + [self.eos_id])
        width = seq_len + 1
        usable = min(len(ids) // width, windows) * width
        return torch.tensor(ids[:usable]).view(-1, width)


def load_teacher(target: str) -> Teacher:
    from verispec.loading import load_target_and_tokenizer

    model, tokenizer = load_target_and_tokenizer(target, kernels=False)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    eos_ids = model.config.eos_ids
    return Teacher(model, tokenizer, eos_ids[-1] if len(eos_ids) > 1 else eos_ids[0], chat_renderer(tokenizer))


def chat_renderer(tokenizer):
    """A ``corpus.ChatRenderer`` through the tokenizer's own chat template; None without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages, add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template([{"role": role, "content": text} for role, text in messages],
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    return render


def draft_from_target(target: LlamaForCausalLM, layers: tuple[int, ...]) -> LlamaForCausalLM:
    """A draft whose layers are copies of the target's ``layers`` and whose embedding (and tied head)
    is the target's very tensor (frozen)."""
    config = replace(target.config, num_hidden_layers=len(layers), tie_word_embeddings=True)
    draft = LlamaForCausalLM(config)
    for index, source in enumerate(layers):
        draft.model.layers[index].load_state_dict(target.model.layers[source].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = draft.model.embed_tokens.weight
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def restricted_distillation_loss(draft: LlamaForCausalLM, teacher: LlamaForCausalLM, tokens: torch.Tensor,
                                 draft_vocab: int, argmax_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """On windows (B, T + 1): cross-entropy of the target's distribution restricted to ids < N (and
    renormalised there) under the draft's distribution over those ids, plus ``argmax_weight`` times
    the cross-entropy of the target's most likely id < N."""
    inputs = tokens[:, :-1]
    with torch.no_grad():  # the target's logits for ids < N only: their softmax is the restricted target
        teacher_hidden = teacher.model.norm(teacher.train_hidden(inputs)[0])
        teacher_logits = F.linear(teacher_hidden, teacher.lm_head.weight[:draft_vocab])  # (B, T, N)
        soft_target = F.softmax(teacher_logits.float(), dim=-1)
        argmax = teacher_logits.argmax(-1)  # (B, T): the target's most likely id among the N
    hidden = draft.model.norm(draft.train_hidden(inputs)[0])
    logits = F.linear(hidden, draft.lm_head.weight[:draft_vocab])  # (B, T, N)
    log_q = F.log_softmax(logits.float(), dim=-1)
    soft = -(soft_target * log_q).sum(-1).mean()
    total, scalars = soft, {"soft_ce": soft.item()}
    if argmax_weight > 0:
        hard = F.nll_loss(log_q.reshape(-1, draft_vocab), argmax.reshape(-1))
        total = total + argmax_weight * hard
        scalars["argmax_ce"] = hard.item()
    with torch.no_grad():
        scalars["greedy_match"] = (log_q.argmax(-1) == argmax).float().mean().item()
    return total, scalars


@torch.no_grad()
def evaluate(draft: LlamaForCausalLM, teacher: LlamaForCausalLM, windows: torch.Tensor, draft_vocab: int,
             micro_batch: int) -> dict[str, float]:
    """Greedy match (the draft's argmax over its ids equals the target's) and the expected acceptance
    of one temperature-1 draft token, sum_x min(p(x), q(x)), on held-out windows (B, T + 1)."""
    matches, accept, count = 0.0, 0.0, 0
    for start in range(0, windows.shape[0], micro_batch):
        inputs = windows[start:start + micro_batch, :-1]
        p = F.softmax(teacher.train_forward(inputs)[0].float(), dim=-1)
        hidden = draft.model.norm(draft.train_hidden(inputs)[0])
        q = F.softmax(F.linear(hidden, draft.lm_head.weight[:draft_vocab]).float(), dim=-1)
        matches += (q.argmax(-1) == p.argmax(-1)).float().sum().item()
        accept += torch.minimum(p[..., :draft_vocab], q).sum(-1).sum().item()
        count += inputs.numel()
    return {"greedy_match": matches / count, "expected_acceptance_t1": accept / count, "positions": count}


def export_draft(draft: LlamaForCausalLM, out_dir: str | Path, recipe: GgufDraftRecipe, target: str) -> None:
    """The draft's own weights (layers, final norm) in bf16 plus a config that marks the embedding as the
    target's; the loader (``loading.load_shared_draft``) fills it in."""
    out_dir = Path(out_dir)
    save_checkpoint(draft, out_dir, dtype=torch.bfloat16)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out_dir / "model.safetensors"))
    weights.pop("model.embed_tokens.weight", None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config.update({SHARED_EMBEDDING_KEY: True, "verispec_draft_vocab": min(recipe.draft_vocab, 8192),
                   "verispec_target": target, "verispec_init_layers": list(recipe.layers)})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def train_gguf_draft(recipe: GgufDraftRecipe, minutes: float, target: str, out_dir: str | Path,
                     run_dir: str | Path, init_dir: str | Path | None = None) -> dict:
    """Distil for ``minutes`` of wall time; ``init_dir`` continues from a draft this function exported
    (its layers and final norm; the embedding stays the target's)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_teacher(target)
    teacher, render, eos_id, encode = loaded.model, loaded.render, loaded.eos_id, loaded.encode
    torch.manual_seed(recipe.optim.seed)
    draft = draft_from_target(teacher, recipe.layers)
    if init_dir is not None:
        from verispec.models.llama import load_checkpoint

        start = load_checkpoint(init_dir, kernels=False, shared_embedding=teacher.model.embed_tokens.weight)
        if start.config.num_hidden_layers != len(recipe.layers):
            raise ValueError(f"--init {init_dir} has {start.config.num_hidden_layers} layers, the recipe "
                             f"{len(recipe.layers)}; pass --layers {start.config.num_hidden_layers}")
        draft.load_state_dict(start.state_dict())
        draft.model.embed_tokens.weight = draft.lm_head.weight = teacher.model.embed_tokens.weight
        logger.info("draft: continuing from %s", init_dir)
    stream = MixedTokenStream(encode, eos_id, recipe.mix, split="train", seed=recipe.optim.seed, render_chat=render)
    batches = WindowBatches(stream, recipe.optim.seq_len, recipe.optim.micro_batch, seed=recipe.optim.seed)
    batches.prime()
    logger.info("draft: %d trainable parameters (target %d)",
                sum(p.numel() for p in draft.parameters() if p.requires_grad), parameter_count(teacher))

    def loss_fn(tokens: torch.Tensor, micro_step: int):
        return restricted_distillation_loss(draft, teacher, tokens, recipe.draft_vocab, recipe.argmax_weight)

    keys = ["loss", "soft_ce", "argmax_ce"]

    def save_latest(step: int, history: TrainHistory) -> None:
        export_draft(draft, run_dir / "checkpoint-latest", recipe, target)
        write_json(run_dir / "history.json", {"records": history.records})

    history = BudgetedLoop(draft, recipe.optim, minutes, on_checkpoint=save_latest).run(batches, loss_fn)
    export_draft(draft, out_dir, recipe, target)
    write_json(run_dir / "history.json", {"records": history.records})
    plot_losses(history.records, keys, run_dir / "loss.png", "draft distillation loss")
    heldout = {}
    for name in corpus.WORKLOADS:
        windows = loaded.heldout_windows(name, recipe.eval.windows_per_workload, recipe.optim.seq_len)
        heldout[name] = evaluate(draft, teacher, windows, recipe.draft_vocab, recipe.eval.micro_batch)
        logger.info("held-out %s: %s", name, heldout[name])
    metrics = {"recipe": asdict(recipe), "target": target, "parameters_trained": sum(
        p.numel() for p in draft.parameters() if p.requires_grad),
        "training": {"steps": history.steps_done, "tokens": history.tokens_seen,
                     "seconds": history.train_seconds, "stream": stream.stats()},
        "heldout": heldout}
    write_json(run_dir / "metrics.json", metrics)
    write_json(Path(out_dir) / "training_metrics.json", metrics)
    return metrics


def export_hf_draft(draft, tokenizer, out_dir: str | Path) -> Path:
    """A self-contained transformers checkpoint of a shared-embedding draft (``loading.load_shared_draft``):
    the target's embedding written into it (float32, the GGUF file's exact dequantized values) and the
    target's tokenizer beside it, so ``AutoModelForCausalLM.from_pretrained`` (e.g. as transformers'
    ``assistant_model``) loads it as it is."""
    out_dir = Path(out_dir)
    config = replace(draft.config, model_type="llama")
    with torch.inference_mode(False):
        plain = LlamaForCausalLM(config)
        plain.load_state_dict({name: tensor.detach().clone() for name, tensor in draft.state_dict().items()})
    save_checkpoint(plain, out_dir, dtype=torch.float32)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
