"""The serving sweep's load without HTTP: closed-loop concurrency 1..64 on a BatchEngine, plain decoding
(gamma 0) vs the adaptive policy, interleaved per load point and repeat, one engine per variant kept
across points as a server keeps its policy. Prints output tokens/s per point, the ratio adaptive/off
(median over repeats) and the adaptive engine's draft time split (catch-up reads vs drafting).

    OMP_NUM_THREADS=1 python docs/experiments/closed_loop.py [--repeats 3] [--points 1,2,4,8,16,32,64]
"""
import argparse, statistics, time, torch
torch.set_num_threads(1)
from verispec.adaptive import AdaptiveGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair

ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--points", default="1,2,4,8,16,32,64")
args = ap.parse_args()
pair = load_pair()
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=22,
                                          max_output_tokens=48), pair.tokenizer, 1024, 6)
G = SamplingParams(temperature=0)
engines = {
    "off": BatchEngine(pair.target, pair.draft, SpecConfig(method="none"), max_batch=64, max_len=1024),
    "adaptive": BatchEngine(pair.target, pair.draft, SpecConfig(method="chain", gamma=4), max_batch=64,
                            max_len=1024, gamma_policy=AdaptiveGamma(max_gamma=4)),
}
reads = {"s": 0.0}
adaptive = engines["adaptive"]
original = adaptive._catch_up_alone
def timed():
    prompts_s, total_s, tokens = original(); reads["s"] += total_s; return prompts_s, total_s, tokens
adaptive._catch_up_alone = timed

def run(engine, concurrency):
    queue = [BatchRequest(p.prompt_id, list(p.prompt_ids), G, StopRules(max_tokens=p.max_tokens, ignore_eos=True))
             for p in prompts]
    tokens, draft_s, rounds, drafted = 0, 0.0, 0, 0
    began, cpu = time.perf_counter(), time.process_time()
    while queue or engine.active:
        while queue and engine.active < concurrency:
            tokens += sum(len(e.tokens) for e in engine.add(queue.pop(0)))
        before = time.perf_counter()
        events = engine.step()
        tokens += sum(len(e.tokens) for e in events)
        rounds += 1
    return tokens / (time.perf_counter() - began), tokens / (time.process_time() - cpu), rounds

points = [int(x) for x in args.points.split(",")]
results = {(v, c): [] for v in engines for c in points}
cpu_results = {(v, c): [] for v in engines for c in points}
for repeat in range(args.repeats):
    for c in points:
        order = list(engines) if (repeat + c) % 2 == 0 else list(engines)[::-1]
        for name in order:
            reads["s"] = 0.0
            rate, cpu_rate, rounds = run(engines[name], c)
            results[(name, c)].append(rate)
            cpu_results[(name, c)].append(cpu_rate)
            extra = f" catch-up/prompt reads {reads['s']*1e3:.0f} ms" if name == "adaptive" else ""
            print(f"rep {repeat} c{c:<3} {name:9s} {rate:7.1f} tok/s (per CPU s {cpu_rate:7.1f})  {rounds} rounds{extra}", flush=True)
for label, table in (("wall", results), ("CPU", cpu_results)):
    print(f"\n{label} time: concurrency  off tok/s  adaptive tok/s  ratio (median of per-repeat ratios)")
    for c in points:
        ratios = [a / o for a, o in zip(table[("adaptive", c)], table[("off", c)])]
        print(f"{c:11d}  {statistics.median(table[('off', c)]):9.1f}  {statistics.median(table[('adaptive', c)]):14.1f}  "
              f"{statistics.median(ratios):.3f}  ({' '.join(f'{r:.3f}' for r in ratios)})")
