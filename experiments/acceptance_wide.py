"""Chain acceptance (gamma 4) of drafts on many held-out prompts: the benchmark's prompt sets (ShareGPT
held-out conversations with the chat template, held-out standard-library code, synthetic arithmetic),
greedy and at temperature 1, every draft on the same prompts and seeds. The model card's measurement
uses 8 prompts per workload; a draft's greedy acceptance on 8 x 64 tokens moves by +/-0.05 with the
handful of trajectories it follows (95% interval ~0.3 wide), so replacing a draft is decided here on
more of them: by default 320 per workload (the held-out code has 330), with a 95% bootstrap interval over
prompts (~0.045 wide on code; ~2.3 minutes per draft on 2 cores).

    OMP_NUM_THREADS=2 python experiments/acceptance_wide.py DRAFT_DIR [DRAFT_DIR ...] [--prompts 320]
"""
import argparse
from verispec.loading import DEFAULT_DRAFT, load_pair
from verispec.train.card import heldout_bench_prompts, report_drafts

ap = argparse.ArgumentParser()
ap.add_argument("drafts", nargs="*", help="draft checkpoint dirs (the shipped draft is always measured first)")
ap.add_argument("--prompts", type=int, default=320, help="prompts per workload (default 320 of the 330 held-out code prompts)")
ap.add_argument("--max-tokens", type=int, default=64)
args = ap.parse_args()
pair = load_pair("tiny", None)
prompts = heldout_bench_prompts(pair.tokenizer, pair.target.config.max_context, args.prompts, args.max_tokens)
print("prompts per workload:", {w: len(p) for w, p in prompts.items()}, flush=True)
drafts = {str(DEFAULT_DRAFT): pair.draft, **{path: load_pair("tiny", path).draft for path in args.drafts}}
report_drafts(pair.target, drafts, prompts, args.max_tokens)
