"""Is one process of the same code as fast as another? Starts N fresh Python processes one after the
other, each loading the embedded target and running plain batched decoding (BatchEngine, gamma 0) at
closed-loop concurrency 16 three times over the serving sweep's 66 prompts; prints each process's
three tokens/s and its median verify (target forward) ms of a 16-row round. Within a process the three
runs agree; across processes they may not, which is why the serving sweep relaunches its servers for
every repeat (docs/benchmarking.md, relaunch).

    OMP_NUM_THREADS=1 python experiments/process_spread.py [--processes 6]
"""
import argparse, statistics, subprocess, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--processes", type=int, default=6)
ap.add_argument("--child", action="store_true")
args = ap.parse_args()

if not args.child:
    for i in range(args.processes):
        out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, check=True)
        print(f"process {i}: {out.stdout.strip()}", flush=True)
    sys.exit(0)

import torch
torch.set_num_threads(1)
from verispec.batch import BatchEngine
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SpecConfig
from verispec.loading import load_pair
from load_loop import closed_loop, greedy_requests

pair = load_pair("tiny", need_draft=False)
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=22,
                                          max_output_tokens=48), pair.tokenizer, 1024, 6)
engine = BatchEngine(pair.target, None, SpecConfig(method="none"), max_batch=64)
verify = []
original = engine._verify
def timed(*a):
    began = time.perf_counter(); result = original(*a)
    verify.append((len(engine.rows), time.perf_counter() - began)); return result
engine._verify = timed

results = []
for _ in range(3):
    verify.clear()
    rate = closed_loop(engine, greedy_requests(prompts), 16)
    full = [t for rows, t in verify if rows == 16]
    results.append(f"{rate:.0f} tok/s (16-row verify {1e3 * statistics.median(full):.2f} ms)")
print(" | ".join(results))
