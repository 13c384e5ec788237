"""Is the embedded target the better model? Held-out perplexity of target and draft on the same windows
(the training runs each report their own evaluation; this puts both on identical tokens), per workload,
with a 95% bootstrap interval for the per-token loss gap (256-token windows resampled); then each model
alone, greedy, on the benchmark's held-out arithmetic prompts, answers scored by the benchmark's check
(the difference target - draft with a paired bootstrap interval). Code is not scored that way: the
benchmark's check wants a function body, and greedy, both models start the next definition instead.

    OMP_NUM_THREADS=1 python experiments/pair_perplexity.py [--windows 96] [--answers 200]
        [--draft DIR] [--target DIR]
"""
import argparse, math
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
from verispec.bench.checks import math_correct
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.engine import SpecEngine
from verispec.loading import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.loading import load_tokenizer as load_hf_tokenizer
from verispec.models.llama import load_checkpoint
from verispec.stats import ratio_interval
from verispec.train import corpus
from verispec.train.evaluate import heldout_windows
from verispec.train.recipes import EOS_TOKEN_ID
from verispec.train.tokenizer import batch_encoder, load_tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--windows", type=int, default=96, help="256-token held-out windows per workload")
ap.add_argument("--answers", type=int, default=200, help="held-out math prompts each model answers (0: skip)")
ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
ap.add_argument("--target", default=str(DEFAULT_TARGET))
args = ap.parse_args()
target = load_checkpoint(args.target, dtype=torch.float32, kernels=False).eval()
draft = load_checkpoint(args.draft, dtype=torch.float32, kernels=False).eval()
encode = batch_encoder(load_tokenizer(args.target))  # the pair shares it


def window_losses(model, windows: torch.Tensor) -> list[float]:
    """Summed next-token loss (nats) of each window."""
    sums = []
    for start in range(0, windows.shape[0], 16):
        batch = windows[start:start + 16]
        logits = model.train_forward(batch[:, :-1])[0].float()
        sums += F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").sum(-1).tolist()
    return sums


with torch.no_grad():
    for name in corpus.WORKLOADS:
        windows = heldout_windows(encode, name, 256, args.windows, EOS_TOKEN_ID)
        counts = [float(windows.shape[1] - 1)] * windows.shape[0]
        t, d = window_losses(target, windows), window_losses(draft, windows)
        t_loss, d_loss = sum(t) / sum(counts), sum(d) / sum(counts)
        low, high = ratio_interval([b - a for a, b in zip(t, d)], counts)
        print(f"{name}: {int(sum(counts))} tokens; target loss {t_loss:.4f} (ppl {math.exp(t_loss):.2f}), draft loss "
              f"{d_loss:.4f} (ppl {math.exp(d_loss):.2f}), draft - target {d_loss - t_loss:+.4f} nats/token "
              f"[{low:+.4f} to {high:+.4f}]; windows where the target is better: "
              f"{sum(a < b for a, b in zip(t, d))}/{len(t)}", flush=True)

if args.answers:
    tokenizer = load_hf_tokenizer(args.target)
    settings = PromptSettings(workloads=("math",), per_workload=args.answers, max_output_tokens=96)
    prompts = build_prompt_set(settings, tokenizer, target.config.max_context)
    greedy, plain = SamplingParams(temperature=0.0), SpecConfig(method="none")
    scores = {}
    for label, model in (("target", target), ("draft", draft)):
        engine = SpecEngine(model)
        for p in prompts:
            result = engine.generate(list(p.prompt_ids), greedy, plain, StopRules(max_tokens=p.max_tokens, ignore_eos=True))
            text = tokenizer.decode(result.tokens, skip_special_tokens=True)
            scores.setdefault(label, []).append(float(math_correct(text.split("\n")[0], p.reference)))
    t, d = scores["target"], scores["draft"]
    low, high = ratio_interval([a - b for a, b in zip(t, d)], [1.0] * len(t))
    print(f"math, {len(t)} held-out prompts, greedy, answers correct: target {sum(t) / len(t):.3f}, draft "
          f"{sum(d) / len(d):.3f}, target - draft {(sum(t) - sum(d)) / len(t):+.3f} [{low:+.3f} to {high:+.3f}]",
          flush=True)
