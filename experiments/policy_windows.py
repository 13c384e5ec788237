"""The adaptive policy's round-time windows against the rounds themselves, SmolLM2's EAGLE head behind
--lookup 3, closed loop at concurrency 4 (closed_loop.py's 66 held-out prompts, 48 greedy tokens, a
client refilling at once): the adaptive engine and fixed gamma 0 and 1 engines in turn, --repeats times;
per run tokens/s, rounds, the rounds' summed time and each gamma's batch-4 round times (median, mean);
after the last, the adaptive policy's windows (median seconds, rows per (bucket, gamma)), its acceptance,
E[N] and prompt cost per token, and the rates it predicts per gamma at batch 4.

    OMP_NUM_THREADS=1 python experiments/policy_windows.py [--repeats 2]
"""
import argparse, statistics, time, torch
torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=2)
args = ap.parse_args()
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import freeze_long_lived_objects, load_pair
pair = load_pair("smollm2", need_eagle=True)
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=22, max_output_tokens=48), pair.tokenizer, 1024, 6)
G = SamplingParams(temperature=0)
def engine(policy, gamma=4):
    return BatchEngine(pair.target, None, SpecConfig(method="chain", gamma=gamma, drafter="eagle", lookup=3), max_batch=64,
                       max_len=1024, gamma_policy=policy, eagle=pair.eagle)
engines = {"adaptive": engine(AdaptiveGamma(max_gamma=4)), "g0": engine(FixedGamma(0)), "g1": engine(FixedGamma(1), 1)}
log = {n: [] for n in engines}
for name, e in engines.items():
    original = e.gamma_policy.observe
    def observe(batch_size, gamma, seconds, accepted, drafted, original=original, name=name):
        log[name].append((batch_size, gamma, seconds, sum(accepted), sum(drafted))); original(batch_size, gamma, seconds, accepted, drafted)
    e.gamma_policy.observe = observe
freeze_long_lived_objects()
def run(e, c=4):
    queue = [BatchRequest(p.prompt_id, list(p.prompt_ids), G, StopRules(max_tokens=p.max_tokens, ignore_eos=True)) for p in prompts]
    tokens, began = 0, time.perf_counter()
    while queue or e.active:
        while queue and e.active < c:
            tokens += sum(len(x.tokens) for x in e.add(queue.pop(0)))
        tokens += sum(len(x.tokens) for x in e.step())
    return tokens / (time.perf_counter() - began)
for rep in range(args.repeats):
    for name, e in engines.items():
        n0 = len(log[name]); rate = run(e)
        rounds = log[name][n0:]
        by = {}
        for b, g, s, a, d in rounds:
            if b == 4: by.setdefault(g, []).append(s)
        step_s = sum(s for _, _, s, _, _ in rounds)
        print(f"rep {rep} {name:8s} {rate:6.1f} tok/s, {len(rounds)} rounds, rounds' time {step_s:.2f} s; batch-4 rounds: " +
              ", ".join(f"g{g}: {len(v)} median {1e3*statistics.median(v):.1f} ms mean {1e3*statistics.mean(v):.1f}" for g, v in sorted(by.items())), flush=True)
p = engines["adaptive"].gamma_policy
print("adaptive windows:", {k: (round(1e3 * v, 1), p.round_rows[k]) for k, v in p.round_seconds.items()})
print("acceptance:", [round(x, 3) for x in p.acceptance()], "E[N]:", [round(x, 3) for x in p.expected(p.acceptance(), 4)],
      "prompt s/token:", round(1e3 * p.prompt_seconds_per_token(), 3), "ms")
print("beliefs:", {g: round(p.predicted_rate(4, g) or 0, 1) for g in p.candidates})
