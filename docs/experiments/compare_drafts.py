"""Chain acceptance (gamma 4) of the shipped draft and candidate drafts on the model card's held-out
prompts, greedy and at temperature 1, with the same seeds: the measurement behind replacing the draft.

    OMP_NUM_THREADS=1 python docs/experiments/compare_drafts.py runs/draft-kl/ckpt [--prompts 8] [--target DIR]
"""
import argparse, sys
import torch
from tqdm import tqdm
torch.set_num_threads(1)
from verispec.config import SpecConfig
from verispec.demo import demo_prompts
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.loading import DEFAULT_DRAFT, load_pair
from verispec.train.card import SETTINGS, acceptance_by_workload

ap = argparse.ArgumentParser()
ap.add_argument("drafts", nargs="+", help="candidate draft checkpoint dirs")
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--target", default=None, help="target checkpoint dir (default: the shipped one)")
args = ap.parse_args()
pair = load_pair(args.target, DEFAULT_DRAFT if args.target else None)
prompts = {w: [pair.tokenizer.encode(p, add_special_tokens=False) for p in items]
           for w, items in demo_prompts(args.prompts).items()}
chain = SpecConfig(method="chain", gamma=4)
for path in [str(DEFAULT_DRAFT)] + args.drafts:
    draft = load_pair(None, path).draft if path != str(DEFAULT_DRAFT) else pair.draft
    engine = SpecEngine(pair.target, DraftModelDrafter(draft))
    progress = tqdm(total=sum(map(len, prompts.values())) * len(SETTINGS), desc=path, file=sys.stderr)
    row = {name: acceptance_by_workload(engine, prompts, chain, sampling, args.max_tokens, progress)
           for name, sampling in SETTINGS.items()}
    progress.close()
    print(path)
    for workload in row["greedy"]:
        g, t = row["greedy"][workload], row["t1"][workload]
        print(f"  {workload}: greedy acceptance {g['acceptance_rate']:.3f} committed/round "
              f"{g['committed_per_round']:.2f}; t=1 acceptance {t['acceptance_rate']:.3f} committed/round "
              f"{t['committed_per_round']:.2f}", flush=True)
