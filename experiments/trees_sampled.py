"""Trees against the chain at matched verification budget D when sampling (temperature 1 by default):
committed tokens per round on planner_check's 12 evaluation prompts (96 tokens each, EOS ignored),
every sibling mode of the static shapes, each prompt decoded with ``--seeds`` seeds. Greedy drafts
are right or wrong together, so a sibling seldom helps (experiments/dynamic_vs_chain.py); sampled
drafts spread over the draft's distribution, where a second sibling is a second chance.

    OMP_NUM_THREADS=1 python experiments/trees_sampled.py [--budgets 5,6,7,8] [--seeds 2]
"""
import argparse
import torch
torch.set_num_threads(1)
from verispec.bench.planner_check import split_prompts
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair, resolve_draft_vocab

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", default="5,6,7,8")
ap.add_argument("--seeds", type=int, default=2)
ap.add_argument("--temperature", type=float, default=1.0)
ap.add_argument("--top-k", type=int, default=0)
ap.add_argument("--modes", default="iid,without_replacement,deterministic")
args = ap.parse_args()
pair = load_pair("tiny")
vocab = resolve_draft_vocab(pair, "auto")
evaluation, _ = split_prompts(pair.tokenizer, 4, pair.target.config.max_context - 140)
sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k)
stop = StopRules(max_tokens=96, ignore_eos=True)
# Static shapes per budget: depth N, top-2 branching, D verified nodes (root included).
SHAPES = {4: ["s2_k2_d4"], 5: ["s3_k2_d5", "s2_k2_d5"], 6: ["s3_k2_d6", "s4_k2_d6"], 7: ["s4_k2_d7", "s3_k2_d7"],
          8: ["s4_k2_d8", "s5_k2_d8", "s3_k3_d8"]}


def run(spec):
    engine = build_engine(pair, spec)
    committed = rounds = tokens = 0
    seconds = 0.0
    for seed in range(args.seeds):
        for prompt in evaluation:
            stats = engine.generate(prompt, sampling, spec, stop, seed=seed).stats
            committed += sum(r.committed for r in stats.rounds)
            rounds += len(stats.rounds)
            seconds += stats.e2e_s - stats.ttft_s
            tokens += stats.generated_tokens - 1
    return committed / rounds, tokens / seconds


for budget in (int(b) for b in args.budgets.split(",")):
    chain, chain_rate = run(SpecConfig(gamma=budget - 1, draft_vocab=vocab))
    cells = [f"chain {chain:.3f} ({chain_rate:.0f} tok/s)"]
    for shape in SHAPES.get(budget, []):
        for mode in args.modes.split(","):
            value, rate = run(SpecConfig(method="tree", tree=shape, sibling_mode=mode, draft_vocab=vocab))
            cells.append(f"{shape} {mode} {value:.3f} ({value / chain - 1:+.1%}, {rate:.0f} tok/s)")
    print(f"D = {budget}: " + "; ".join(cells), flush=True)
