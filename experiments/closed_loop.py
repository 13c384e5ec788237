"""The serving sweep's load without HTTP: closed-loop concurrency 1..64 on a BatchEngine, plain decoding
(gamma 0) vs the adaptive policy, interleaved per load point and repeat, one engine per variant kept
across points as a server keeps its policy. Prints output tokens/s per point, the ratio adaptive/off
(median of per-repeat ratios), the adaptive engine's draft reads (prompts and backlogs) per point and,
with --trace, the gammas it ran as runs of "bucket:gamma x rounds".

    OMP_NUM_THREADS=1 python experiments/closed_loop.py [--target smollm2] [--repeats 3] [--points 1,2,4,8,16,32,64]
        [--trace] [--eagle shipped|DIR [--lookup N] [--fixed 1,2]] [--aa] [--beliefs]

--eagle adds the adaptive policy over an EAGLE head's chains (drafted for all rows at once, as
``verispec serve --method eagle`` runs them); --lookup N with it adds the same with lookup first
(``--lookup N``: rows whose context repeats draft the repeat); --fixed G,... adds the head's chains at fixed
gammas (behind the lookup with --lookup), the yardstick for the policy's choice; --beliefs prints, after each
adaptive run, the tokens/s the policy predicted per gamma at that load (from its median round times and
acceptance), to set beside what the fixed variants measured.
"""
import argparse, statistics, time, torch
torch.set_num_threads(1)
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.bench.config import PromptSettings
from verispec.bench.workloads import build_prompt_set
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import freeze_long_lived_objects, load_pair, resolve_draft_vocab

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="tiny", help="tiny (default) or smollm2")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--points", default="1,2,4,8,16,32,64")
ap.add_argument("--trace", action="store_true")
ap.add_argument("--refill", type=int, default=1, help="rounds before a finished request's replacement arrives "
                "(a client's round trip; 0: at once)")
ap.add_argument("--hold", default="16", help="AdaptiveGamma hold_rounds; several (16,1) add variants")
ap.add_argument("--gamma0", action="store_true", help="add a variant with the draft attached but held at gamma 0")
ap.add_argument("--aa", action="store_true", help="add a second plain engine (an A/A check of the method's noise)")
ap.add_argument("--budget", default="", help="AdaptiveGamma switch_budget variants to add, e.g. 0.005,0.01")
ap.add_argument("--eagle", default=None, help="add an 'eagle' variant: the adaptive policy over this head's chains "
                "(a head dir, or 'shipped' for the target's shipped head)")
ap.add_argument("--lookup", type=int, default=0, help="with --eagle, add 'eagle+lookup': the same with --lookup N")
ap.add_argument("--fixed", default="", help="with --eagle, add 'eagle gG' variants at these fixed gammas (e.g. 1,2): "
                "what the adaptive policy's choice is measured against")
ap.add_argument("--skip", default="", help="variants to leave out, e.g. adaptive (the draft model's)")
ap.add_argument("--beliefs", action="store_true", help="after each adaptive run, print the policy's predicted "
                "tokens/s per gamma in that concurrency's bucket (what it chose from)")
ap.add_argument("--no-attention-pairs", action="store_true", help="attention one query at a time (kernels."
                "set_attention_pairs(False)): the same tokens, for an A/B of its speed")
args = ap.parse_args()
if args.no_attention_pairs:
    from verispec import kernels
    kernels.library()
    kernels.set_attention_pairs(False)
pair = load_pair(args.target, need_eagle=args.eagle is not None,
                 eagle_dir=None if args.eagle in (None, "shipped") else args.eagle)
vocab = resolve_draft_vocab(pair, "auto")  # as verispec serve does
prompts = build_prompt_set(PromptSettings(workloads=("sharegpt", "code", "math"), per_workload=22,
                                          max_output_tokens=48), pair.tokenizer, 1024, 6)
G = SamplingParams(temperature=0)
engines = {
    "off": BatchEngine(pair.target, pair.draft, SpecConfig(method="none"), max_batch=64, max_len=1024),
}
for i, hold in enumerate(int(h) for h in args.hold.split(",")):
    engines["adaptive" if i == 0 else f"hold{hold}"] = BatchEngine(
        pair.target, pair.draft, SpecConfig(method="chain", gamma=4, draft_vocab=vocab), max_batch=64, max_len=1024,
        gamma_policy=AdaptiveGamma(max_gamma=4, hold_rounds=hold))
for budget in (float(b) for b in args.budget.split(",") if b):
    engines[f"budget{budget:g}"] = BatchEngine(
        pair.target, pair.draft, SpecConfig(method="chain", gamma=4, draft_vocab=vocab), max_batch=64, max_len=1024,
        gamma_policy=AdaptiveGamma(max_gamma=4, switch_budget=budget))
if args.eagle is not None:
    engines["eagle"] = BatchEngine(pair.target, None, SpecConfig(method="chain", gamma=4, drafter="eagle"), max_batch=64,
                                   max_len=1024, gamma_policy=AdaptiveGamma(max_gamma=4), eagle=pair.eagle)
if args.eagle is not None and args.lookup:
    engines["eagle+lookup"] = BatchEngine(pair.target, None, SpecConfig(method="chain", gamma=4, drafter="eagle",
                                                                       lookup=args.lookup), max_batch=64,
                                          max_len=1024, gamma_policy=AdaptiveGamma(max_gamma=4), eagle=pair.eagle)
for gamma in (int(g) for g in args.fixed.split(",") if g and args.eagle is not None):
    fixed = SpecConfig(method="chain", gamma=gamma, drafter="eagle", lookup=args.lookup)
    engines[f"eagle{'+lookup' if args.lookup else ''} g{gamma}"] = BatchEngine(
        pair.target, None, fixed, max_batch=64, max_len=1024, eagle=pair.eagle)
if args.aa:
    engines["off2"] = BatchEngine(pair.target, pair.draft, SpecConfig(method="none"), max_batch=64, max_len=1024)
if args.gamma0:
    engines["gamma0"] = BatchEngine(pair.target, pair.draft, SpecConfig(method="chain", gamma=4, draft_vocab=vocab),
                                    max_batch=64, max_len=1024, gamma_policy=FixedGamma(0))
for name in (n for n in args.skip.split(",") if n):
    del engines[name]
reads = {}  # variant -> seconds its draft spent in catch-up and prompt reads this run
ran = {}  # variant -> (bucket, gamma) per round its policy observed
def instrument(name, engine):
    reads[name], ran[name] = 0.0, []
    original, policy_observe = engine.draft.catch_up_alone, engine.gamma_policy.observe
    def timed(rows):
        prompts_s, prompts, total_s, tokens = original(rows); reads[name] += total_s
        return prompts_s, prompts, total_s, tokens
    def observe(batch_size, gamma, *rest):
        ran[name].append((AdaptiveGamma.bucket(batch_size), gamma)); policy_observe(batch_size, gamma, *rest)
    engine.draft.catch_up_alone, engine.gamma_policy.observe = timed, observe
for name in ("adaptive", "eagle", "eagle+lookup"):
    if name in engines:
        instrument(name, engines[name])
freeze_long_lived_objects()  # as verispec serve does

def runs_of(rounds):
    out = []
    for key in rounds:
        if out and out[-1][0] == key: out[-1][1] += 1
        else: out.append([key, 1])
    return " ".join(f"{b}:{g}x{n}" for (b, g), n in out)

def run(engine, concurrency):
    queue = [BatchRequest(p.prompt_id, list(p.prompt_ids), G, StopRules(max_tokens=p.max_tokens, ignore_eos=True))
             for p in prompts]
    tokens, rounds, slots = 0, 0, [0] * concurrency  # slots: round at which each client sends again
    began, cpu = time.perf_counter(), time.process_time()
    while queue or engine.active:
        ready = sum(1 for s in slots if s <= rounds)
        while queue and ready and engine.active < concurrency:
            slots.remove(next(s for s in slots if s <= rounds)); ready -= 1
            added = engine.add(queue.pop(0))
            tokens += sum(len(e.tokens) for e in added)
            slots += [rounds + args.refill] * sum(1 for e in added if e.finished)
        events = engine.step()
        rounds += 1
        tokens += sum(len(e.tokens) for e in events)
        slots += [rounds + args.refill] * sum(1 for e in events if e.finished)
    return tokens / (time.perf_counter() - began), tokens / (time.process_time() - cpu), rounds

points = [int(x) for x in args.points.split(",")]
results = {(v, c): [] for v in engines for c in points}
cpu_results = {(v, c): [] for v in engines for c in points}
for repeat in range(args.repeats):
    for c in points:
        names = list(engines)
        shift = (repeat + points.index(c)) % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            if name in reads:
                reads[name] = 0.0
                ran[name].clear()
            rate, cpu_rate, rounds = run(engines[name], c)
            results[(name, c)].append(rate)
            cpu_results[(name, c)].append(cpu_rate)
            extra = f" catch-up/prompt reads {reads[name]*1e3:.0f} ms" if name in reads else ""
            print(f"rep {repeat} c{c:<3} {name:9s} {rate:7.1f} tok/s (per CPU s {cpu_rate:7.1f})  {rounds} rounds{extra}", flush=True)
            if args.trace and name in ran:
                print("    " + runs_of(ran[name]), flush=True)
            policy = engines[name].gamma_policy
            if args.beliefs and isinstance(policy, AdaptiveGamma):
                plain = policy.predicted_rate(c, 0)
                beliefs = {g: policy.predicted_rate(c, g) for g in policy.candidates}
                print("    beliefs (tok/s, x gamma 0): " + " ".join(
                    f"g{g} {r:.1f} ({r / plain:.3f})" if plain else f"g{g} {r:.1f}"
                    for g, r in beliefs.items() if r), flush=True)
for label, table in (("wall", results), ("CPU", cpu_results)):
    for name in list(engines)[1:]:
        print(f"\n{label} time: concurrency  off tok/s  {name} tok/s  ratio (median of per-repeat ratios)")
        for c in points:
            ratios = [a / o for a, o in zip(table[(name, c)], table[("off", c)])]
            print(f"{c:11d}  {statistics.median(table[('off', c)]):9.1f}  {statistics.median(table[(name, c)]):9.1f}  "
                  f"{statistics.median(ratios):.3f}  ({' '.join(f'{r:.3f}' for r in ratios)})")
