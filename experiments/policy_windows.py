"""The adaptive policy's round-time windows against the rounds themselves, SmolLM2's EAGLE head behind
--lookup 3, closed loop at concurrency 4 (closed_loop.py's 66 held-out prompts, 48 greedy tokens, a
client refilling at once): the adaptive engine and fixed gamma 0 and 1 engines in turn, --repeats times;
per run tokens/s, rounds, the rounds' summed time and each gamma's batch-4 round times (median, mean);
after the last, the adaptive policy's windows (median seconds, rows per (bucket, gamma)), its acceptance,
E[N] and prompt cost per token, and the rates it predicts per gamma at batch 4. With --runs, the
adaptive engine's batch-4 gamma-1 rounds split by whether a gamma-0 round came just before, and each run
of gamma 1 with the rounds around it (gamma, ms): how round times move within a run.

    OMP_NUM_THREADS=1 python experiments/policy_windows.py [--repeats 2] [--engines adaptive,g0,g1] [--runs]
"""
import argparse, statistics, torch
torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--engines", default="adaptive,g0,g1", help="which of adaptive, g0, g1 to run")
ap.add_argument("--runs", action="store_true", help="print the adaptive engine's gamma-1 runs (needs adaptive)")
args = ap.parse_args()
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.batch import BatchEngine
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SpecConfig
from verispec.loading import freeze_long_lived_objects, load_pair
from load_loop import closed_loop, greedy_requests
pair = load_pair("smollm2", need_eagle=True)
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=22, max_output_tokens=48), pair.tokenizer, 1024, 6)
def engine(policy, gamma=4):
    return BatchEngine(pair.target, None, SpecConfig(method="chain", gamma=gamma, drafter="eagle", lookup=3), max_batch=64,
                       max_len=1024, gamma_policy=policy, eagle=pair.eagle)
makers = {"adaptive": lambda: engine(AdaptiveGamma(max_gamma=4)), "g0": lambda: engine(FixedGamma(0)),
          "g1": lambda: engine(FixedGamma(1), 1)}
engines = {name: makers[name]() for name in args.engines.split(",")}
log = {n: [] for n in engines}
for name, e in engines.items():
    original = e.gamma_policy.observe
    def observe(batch_size, gamma, seconds, accepted, drafted, original=original, name=name):
        log[name].append((batch_size, gamma, seconds)); original(batch_size, gamma, seconds, accepted, drafted)
    e.gamma_policy.observe = observe
freeze_long_lived_objects()
for rep in range(args.repeats):
    for name, e in engines.items():
        n0 = len(log[name]); rate = closed_loop(e, greedy_requests(prompts), 4)
        rounds = log[name][n0:]
        by = {}
        for b, g, s in rounds:
            if b == 4: by.setdefault(g, []).append(s)
        step_s = sum(s for _, _, s in rounds)
        print(f"rep {rep} {name:8s} {rate:6.1f} tok/s, {len(rounds)} rounds, rounds' time {step_s:.2f} s; batch-4 rounds: " +
              ", ".join(f"g{g}: {len(v)} median {1e3*statistics.median(v):.1f} ms mean {1e3*statistics.mean(v):.1f}" for g, v in sorted(by.items())), flush=True)
if "adaptive" in engines:
    p = engines["adaptive"].gamma_policy
    print("adaptive windows:", {k: (round(1e3 * v, 1), p.round_rows[k]) for k, v in p.round_seconds.items()})
    print("acceptance:", [round(x, 3) for x in p.acceptance()], "E[N]:", [round(x, 3) for x in p.expected(p.acceptance(), 4)],
          "prompt s/token:", round(1e3 * p.prompt_seconds_per_token(), 3), "ms")
    print("beliefs:", {g: round(p.predicted_rate(4, g) or 0, 1) for g in p.candidates})
if args.runs and "adaptive" in engines:
    seq = [(g, s) for b, g, s in log["adaptive"] if b == 4]
    after0 = [s for (g0, _), (g, s) in zip(seq, seq[1:]) if g == 1 and g0 == 0]
    after_spec = [s for (g0, _), (g, s) in zip(seq, seq[1:]) if g == 1 and g0 != 0]
    for label, times in (("right after a gamma-0 round", after0), ("after a speculative round", after_spec)):
        if times:
            print(f"gamma-1 rounds {label}: {len(times)}, median {1e3 * statistics.median(times):.1f} ms")
    for i, (g, _) in enumerate(seq):
        if g == 1 and (i == 0 or seq[i - 1][0] != 1):
            print(f"gamma-1 run from batch-4 round {i}:", [(gg, round(1e3 * s, 1)) for gg, s in seq[max(0, i - 2):i + 5]])
