"""Chain acceptance (gamma 4) of the shipped draft and candidate drafts on the model card's held-out
prompts, greedy and at temperature 1, with the same seeds: the measurement behind replacing the draft.

    OMP_NUM_THREADS=1 python experiments/compare_drafts.py runs/draft-kl/ckpt [--prompts 8] [--target DIR]
"""
import argparse
import torch
torch.set_num_threads(1)
from verispec.demo import demo_prompts
from verispec.loading import DEFAULT_DRAFT, load_pair
from verispec.train.card import report_drafts

ap = argparse.ArgumentParser()
ap.add_argument("drafts", nargs="+", help="candidate draft checkpoint dirs")
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--target", default=None, help="target checkpoint dir (default: the shipped one)")
args = ap.parse_args()
pair = load_pair(args.target or "tiny", DEFAULT_DRAFT if args.target else None)
prompts = {w: [pair.tokenizer.encode(p, add_special_tokens=False) for p in items]
           for w, items in demo_prompts(args.prompts).items()}
drafts = {str(DEFAULT_DRAFT): pair.draft, **{path: load_pair("tiny", path).draft for path in args.drafts}}
report_drafts(pair.target, drafts, prompts, args.max_tokens)
