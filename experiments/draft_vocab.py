"""Draft vocabulary limit at concurrency 1 and 4 on the batch engine: plain decoding against chain
gamma 3 with the whole draft vocabulary and with the 4096 / 2048 / 1024 lowest ids (the embedded
tokenizer numbers BPE tokens by merge order); 24 held-out prompts, 48 greedy tokens, medians of 3
interleaved repeats, output tokens/s.

    OMP_NUM_THREADS=1 python experiments/draft_vocab.py
"""
import time, torch
torch.set_num_threads(1)
from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair
pair = load_pair("tiny")
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=8, max_output_tokens=48), pair.tokenizer, 1024, 6)
greedy = SamplingParams(temperature=0)
def run(e, conc):
    began, tokens, queue, outs = time.perf_counter(), 0, list(prompts), {}
    rounds = 0
    while queue or e.active:
        while queue and e.active < conc:
            p = queue.pop(0)
            for x in e.add(BatchRequest(p.prompt_id, list(p.prompt_ids), greedy, StopRules(max_tokens=p.max_tokens, ignore_eos=True))):
                tokens += len(x.tokens); outs.setdefault(x.request_id if hasattr(x,'request_id') else id(x), [])
        ev = e.step(); tokens += sum(len(x.tokens) for x in ev); rounds += 1
    return tokens / (time.perf_counter() - began)
variants = {"off": SpecConfig(method="none"), "g3": SpecConfig(gamma=3), "g3 v4096": SpecConfig(gamma=3, draft_vocab=4096),
            "g3 v2048": SpecConfig(gamma=3, draft_vocab=2048), "g3 v1024": SpecConfig(gamma=3, draft_vocab=1024)}
for conc in (1, 4):
    engines = {n: BatchEngine(pair.target, pair.draft, s, max_batch=64) for n, s in variants.items()}
    for e in engines.values(): run(e, conc)
    res = {n: [] for n in variants}
    for r in range(3):
        for n, e in engines.items(): res[n].append(run(e, conc))
    import statistics
    print(f"c{conc}: " + "  ".join(f"{n} {statistics.median(v):.0f} ({statistics.median(v)/statistics.median(res['off']):.2f}x)" for n, v in res.items()), flush=True)
