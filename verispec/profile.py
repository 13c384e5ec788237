"""``verispec profile``: measure the costs the planner needs, on this hardware.

    verispec profile --target DIR --draft DIR --out profile.json [--plot verify.png]

Measured (medians of interleaved repeats, milliseconds):
- ``decode_ms``: one target forward of 1 new token after a ``context``-token prefix (plain decoding);
- ``verify_ms[n]``: one target forward of n new positions (a chain), n = 1..max_positions;
- ``tree_verify_ms[shape]``: one forward of a static tree shape with its ancestor mask;
- ``draft_ms``: one draft-model step of 1 token as the drafter takes it (the last position's logits,
  only ids < ``draft_vocab`` when given): the cost per proposed token;
- ``state_ms``: cache bookkeeping of a round (commit / rollback; compaction of a scattered tree path);
- ``calibration`` (optional): per-position conditional acceptance of the draft on held-out prompts,
  measured with the engine at ``max gamma`` (not an iid assumption), and the same runs' in-situ costs
  (draft per token, verify, overhead per round, plain decoding per token inside real loops).

The planner (``plan_from_profile``) combines them with the cost model: for each gamma,
cycle = gamma * draft_ms + verify_ms[gamma + 1] + state_ms, E[N] from the measured acceptance, and
predicted speedup = decode_ms / (cycle / E[N]). With in-situ costs, those replace the isolated ones and
the verify curve is mapped affinely onto them (1 position -> in-situ plain decoding, the calibration
width -> in-situ verify time), so the profile gives only its shape. That shape is first made
non-decreasing in the number of positions (``monotone``): more positions never cost less, and the
profile's noise (a few percent per point) otherwise ranks neighbouring gammas at random. The in-situ costs are
measured right next to the runs they predict and include what a real round pays around the forwards;
isolated costs alone predicted every gamma 15-25% too high in the planner check (``python -m
verispec.bench.planner_check``; whether machine state or cache effects cause the gap is not known).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from verispec import costmodel
from verispec.adaptive import CycleGamma, FixedGamma
from verispec.config import SamplingParams, SpecConfig, StopRules, TreeShape
from verispec.roofline import measure_bandwidth_gb_s, roofline, weight_bytes_per_token  # noqa: F401  (re-exported)
from verispec.drafters.base import head_args
from verispec.errors import VerispecError
from verispec.models.llama import LlamaForCausalLM
from verispec.tree import TokenTree

DEFAULT_TREE_SHAPES = ("s3_k2_d6", "s4_k2_d8", "s2_k3_d7", "s5_k2_d9")


def _median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def _prefilled_cache(model: LlamaForCausalLM, context: int, extra: int):
    cache = model.new_cache(1, context + extra + 1)
    model.forward(torch.randint(0, model.config.vocab_size, (1, context)), cache)
    cache.commit(0, context)
    return cache


def measure_forward_ms(model: LlamaForCausalLM, positions: int, context: int, repeats: int,
                       tree: TokenTree | None = None, **forward_kwargs) -> float:
    """Median ms of one forward over ``positions`` new tokens after ``context`` committed ones;
    ``forward_kwargs`` (e.g. last_only, vocab_limit) go to every forward."""
    return measure_interleaved(model, {"unit": (positions, tree)}, context, repeats, forward=forward_kwargs)["unit"]


def measure_interleaved(model: LlamaForCausalLM, units: dict[str, tuple[int, TokenTree | None]], context: int,
                        repeats: int, progress=None, forward: dict | None = None) -> dict[str, float]:
    """Median ms of one forward per unit (name -> (new positions, tree or None for a chain)), all after
    the same ``context``-token prefix. Every pass times each unit once, in an order rotated per pass,
    so slow drifts of the machine (frequency, cache contents, other jobs) hit every unit alike instead
    of bending the curve between neighbouring positions."""
    names = list(units)
    cache = _prefilled_cache(model, context, max(positions for positions, _ in units.values()))
    calls = {}
    for name, (positions, tree) in units.items():
        tokens = torch.randint(0, model.config.vocab_size, (1, positions))
        kwargs = dict(forward or {})
        if tree is not None:
            buffers = tree.compile()
            kwargs.update(tree_mask=buffers.ancestor_mask, depths=buffers.depths)
        calls[name] = (tokens, kwargs)
        model.forward(tokens, cache, **kwargs)  # warm-up (nothing is committed)
    times: dict[str, list[float]] = {name: [] for name in names}
    passes = range(repeats)
    for index in (progress(passes) if progress else passes):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            tokens, kwargs = calls[name]
            began = time.perf_counter()
            model.forward(tokens, cache, **kwargs)
            times[name].append(1e3 * (time.perf_counter() - began))
    return {name: statistics.median(values) for name, values in times.items()}


def static_tree(shape: TreeShape) -> TokenTree:
    """The topology ``DraftModelDrafter.propose_tree`` builds for a static shape (tokens arbitrary)."""
    parents, extras, main = [-1], shape.num_drafts - shape.depth, 0
    for _ in range(shape.depth):
        width = 1 + min(shape.branching - 1, extras)
        extras -= width - 1
        first = len(parents)
        parents += [main] * width
        main = first
    return TokenTree(parents=parents, tokens=[0] * len(parents))


def measure_state_ms(model: LlamaForCausalLM, context: int, repeats: int) -> dict[str, float]:
    cache = _prefilled_cache(model, context, 16)
    length = cache.lengths[0]

    def rollback():
        cache.commit(0, 3)
        cache.set_length(0, length)

    def compact():
        cache.compact(0, [length, length + 2, length + 5, length + 7])
        cache.set_length(0, length)

    return {"chain_commit_ms": _median_ms(rollback, repeats), "tree_compact_ms": _median_ms(compact, repeats)}


def calibrate(engine, prompts: list[list[int]], gamma: int, max_tokens: int,
              plain_engine=None, cycle: bool = True) -> dict:
    """Greedy chain runs of the engine on ``prompts``: conditional acceptance per draft position, and with
    ``plain_engine`` the costs as they are *in situ*, inside real decoding loops (``in_situ_costs``).
    With ``cycle`` the rounds draft 1, 2, ..., ``gamma`` tokens in turn (``CycleGamma``), so every
    width's round is timed in situ; otherwise every round drafts ``gamma``."""
    reached = [0] * (gamma + 1)
    accepted = [0] * (gamma + 1)
    rounds, spec, plain, matches = [], [], [], []
    draft_model = getattr(engine.drafter, "model", None)  # replayed below when it is a native model
    if not isinstance(draft_model, LlamaForCausalLM):
        draft_model = None
    stop = StopRules(max_tokens=max_tokens, ignore_eos=True)
    policy = engine.gamma_policy
    engine.gamma_policy = CycleGamma(gamma) if cycle else FixedGamma(gamma)
    try:
        for prompt in prompts:
            result = engine.generate(prompt, SamplingParams(temperature=0), SpecConfig(gamma=gamma), stop)
            spec.append(result.stats)
            rounds += result.stats.rounds
            for record in result.stats.rounds:
                for position in range(1, min(record.drafted, record.accepted + 1) + 1):
                    reached[position] += 1
                    accepted[position] += position <= record.accepted
            if plain_engine is not None:
                result = plain_engine.generate(prompt, SamplingParams(temperature=0), SpecConfig(method="none"), stop)
                plain.append(result.stats)
                if draft_model is not None:
                    matches.append(greedy_matches(draft_model, prompt, result.tokens,
                                                  getattr(engine.drafter, "vocab_limit", None)))
    finally:
        engine.gamma_policy = policy
    out = {"prompts": len(prompts), "gamma": gamma, "cycle": cycle,
           "acceptance": [accepted[i] / reached[i] if reached[i] else 0.0 for i in range(1, gamma + 1)]}
    if matches:
        out["tokens_per_round"] = {str(g): simulate_greedy_chain(matches, g) for g in range(1, gamma + 1)}
    if plain and any(r.drafted == gamma for r in rounds):
        out["in_situ"] = in_situ_costs(rounds, gamma, spec, plain)
    return out


def greedy_matches(draft: LlamaForCausalLM, prompt: list[int], generated: list[int],
                   vocab_limit: int | None = None) -> list[bool]:
    """For each generated token after the first, whether the draft's greedy choice (among ids <
    ``vocab_limit``, if given) given everything before it (teacher-forced: one pass over prompt +
    generated) is that token."""
    tokens = list(prompt) + list(generated)
    cache = draft.new_cache(1, len(tokens))
    with torch.inference_mode():
        logits = draft.forward(torch.tensor([tokens]), cache, vocab_limit=vocab_limit)[0]
    predicted = logits[len(prompt):len(tokens) - 1].argmax(-1).tolist()  # position j predicts token j + 1
    return [p == t for p, t in zip(predicted, generated[1:])]


def simulate_greedy_chain(matches: list[list[bool]], gamma: int) -> float:
    """Committed tokens per round of greedy chain speculation with ``gamma`` drafts, replayed exactly
    from each request's ``greedy_matches`` (greedy speculation commits plain decoding's tokens, and a
    draft is accepted iff the draft's greedy choice matches): rounds start after the prefill's token,
    accept the run of matches up to gamma (and up to one short of the tokens left), commit one more.
    Pooled over requests as the engine's stats pool rounds. Unlike the product of per-position rates,
    this keeps where rounds start: after a rejection, in the stretch the draft found hard."""
    committed = rounds = 0
    for request in matches:
        total, start = len(request) + 1, 1  # generated tokens; token 0 came from the prefill
        while start < total:
            drafts = min(gamma, total - start - 1)
            run = 0
            while run < drafts and request[start - 1 + run]:
                run += 1
            committed += run + 1
            rounds += 1
            start += run + 1
    return committed / rounds if rounds else 1.0


def in_situ_costs(rounds, gamma: int, spec_stats, plain_stats) -> dict:
    """Costs measured inside real decoding (ms), as real loops pay them (sampling and bookkeeping
    included, the draft and target alternating on the same caches):

    - ``round_ms``: per drafted width, the mean round, the draft's reads of a prompt or backlog excluded;
    - ``read_ms_per_token``: those reads, per decoded token of the speculative runs (a cost per request);
    - at width ``gamma``: draft per drafted token, verify of gamma + 1 positions, state + overhead;
    - ``decode_ms``: plain decoding per token."""
    by_width: dict[int, list] = {}
    for r in rounds:
        if r.drafted > 0:
            by_width.setdefault(r.drafted, []).append(r)
    top = by_width[gamma]
    widths = sorted(by_width)
    round_ms = {w: 1e3 * statistics.fmean(r.total_s - r.draft_read_s for r in by_width[w]) for w in widths}
    decode_s = sum(s.e2e_s - s.ttft_s for s in plain_stats)
    decode_tokens = sum(s.generated_tokens - 1 for s in plain_stats)
    return {"rounds": len(top),
            "draft_ms": 1e3 * sum(r.draft_s - r.draft_read_s for r in top) / sum(r.drafted for r in top),
            "verify_ms": 1e3 * sum(r.verify_s for r in top) / len(top),
            "state_ms": 1e3 * sum(r.state_s + r.other_s for r in top) / len(top),
            "decode_ms": 1e3 * decode_s / max(decode_tokens, 1),
            "round_ms": {str(w): ms for w, ms in round_ms.items()},
            "rounds_by_width": {str(w): len(by_width[w]) for w in widths},
            "read_ms_per_token": 1e3 * sum(r.draft_read_s for r in rounds)
            / max(sum(s.generated_tokens - 1 for s in spec_stats), 1)}


def profile(target: LlamaForCausalLM, draft: LlamaForCausalLM | None, context: int = 128,
            max_positions: int = 32, repeats: int = 15, tree_shapes=DEFAULT_TREE_SHAPES,
            progress=None, draft_vocab: int | None = None) -> dict:
    steps = list(range(1, max_positions + 1))
    from verispec import kernels

    result = {"context": context, "repeats": repeats, "threads": torch.get_num_threads(),
              "small_m_kernel": kernels.status(target), "verify_ms": {}, "tree_verify_ms": {}}
    units = {str(n): (n, None) for n in steps}
    for name in tree_shapes:
        tree = static_tree(TreeShape.parse(name))
        units[name] = (len(tree.parents), tree)
    measured = measure_interleaved(target, units, context, repeats, progress)
    result["verify_ms"] = {str(n): measured[str(n)] for n in steps}
    result["tree_verify_ms"] = {name: measured[name] for name in tree_shapes}
    result["decode_ms"] = result["verify_ms"]["1"]
    if draft is not None:  # one draft step as the drafter takes it: the last position's logits, its ids
        result["draft_ms"] = measure_forward_ms(draft, 1, context, repeats, last_only=True, **head_args(draft_vocab))
        result["draft_vocab"] = draft_vocab
    result.update(measure_state_ms(target, context, repeats))
    result["state_ms"] = result["chain_commit_ms"]
    result.update(roofline(target, result["decode_ms"], context))
    return result


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators:
    each run that decreases is replaced by its mean)."""
    pools: list[list[float]] = []  # [mean, count]
    for value in values:
        pools.append([value, 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (mean_b, count_b), (mean_a, count_a) = pools.pop(), pools.pop()
            count = count_a + count_b
            pools.append([(mean_a * count_a + mean_b * count_b) / count, count])
    return [mean for mean, count in pools for _ in range(count)]


def affine_fit(values: dict[int, float], weights: dict[int, float]) -> dict[int, float]:
    """``values`` (x -> y) replaced by the weighted least-squares line a + b x through them; with fewer
    than 3 points, or a falling line, the values made non-decreasing instead (a dip is noise)."""
    xs = sorted(values)
    total = sum(weights[x] for x in xs)
    if len(xs) >= 3 and total > 0:
        mean_x = sum(weights[x] * x for x in xs) / total
        mean_y = sum(weights[x] * values[x] for x in xs) / total
        spread = sum(weights[x] * (x - mean_x) ** 2 for x in xs)
        slope = sum(weights[x] * (x - mean_x) * (values[x] - mean_y) for x in xs) / spread
        if slope >= 0:
            return {x: mean_y + slope * (x - mean_x) for x in xs}
    return dict(zip(xs, monotone([values[x] for x in xs])))


def local_fit(values: dict[int, float], weights: dict[int, float], width: int = 3) -> dict[int, float]:
    """``values`` (x -> y) each replaced by the weighted least-squares line through the ``width`` nearest
    x (itself included; the smaller on a tie), then made non-decreasing: noise in one x is averaged with its
    neighbours while the curve keeps its bends. Fewer than ``width`` points: ``affine_fit``."""
    xs = sorted(values)
    if len(xs) < width:
        return affine_fit(values, weights)
    fitted = []
    for x in xs:
        near = sorted(xs, key=lambda other: (abs(other - x), other))[:width]
        fitted.append(affine_fit({v: values[v] for v in near}, {v: weights[v] for v in near})[x])
    return dict(zip(xs, monotone(fitted)))


def plan_from_profile(profile_data: dict, acceptance: list[float] | None = None, max_gamma: int | None = None):
    """Predicted plans for gamma 0 (plain decoding, speedup 1 by definition) .. max_gamma from a
    profile (and its calibration, if any)."""
    calibration = profile_data.get("calibration", {})
    acceptance = acceptance or calibration.get("acceptance")
    if not acceptance:
        raise ValueError("no acceptance: pass --acceptance or profile with --calibrate")
    positions = sorted(int(n) for n in profile_data["verify_ms"])
    # Verifying more positions never costs less: a profiled dip is noise, and one at the wrong place
    # (a plain decoding step measured above two positions) moved the planner's choice.
    verify = dict(zip(positions, monotone([profile_data["verify_ms"][str(n)] for n in positions])))
    top = min(max_gamma or len(verify) - 1, len(verify) - 1)
    costs = dict(draft_ms=profile_data["draft_ms"], state_ms=profile_data["state_ms"],
                 baseline_ms=verify[1])  # the decode step, fitted with the curve
    in_situ = calibration.get("in_situ")
    if in_situ and str(calibration["gamma"] + 1) in profile_data["verify_ms"]:
        # The profile gives the verify curve's shape; the in-situ run at the calibration gamma gives
        # its level, and the draft, overhead and plain-decoding costs as a real loop pays them. One
        # position is a plain decoding step (gamma 0 is plain decoding: speedup 1 exactly).
        # Affine map of the profiled curve through both in-situ anchors: 1 position -> in-situ plain
        # decoding, the calibration width -> in-situ verify. (Scaling by the top anchor alone put short
        # verifications below a plain decoding step and made small gammas look 10-20% too good.)
        width = calibration["gamma"] + 1
        low, high = in_situ["decode_ms"], in_situ["verify_ms"]
        span = verify[width] - verify[1]
        slope = (high - low) / span if span > 0 else 1.0
        costs = dict(draft_ms=in_situ["draft_ms"], state_ms=in_situ["state_ms"], baseline_ms=low)
        verify = {n: low + slope * (ms - verify[1]) for n, ms in verify.items()}
    if in_situ and in_situ.get("round_ms"):
        # A cycling calibration timed every width's whole round in one loop. Each width's cycle is the
        # least-squares line through it and its two nearest widths (weighted by rounds per width): one
        # width's ~20 rounds alone moved its prediction by 10%, while one line through all widths missed
        # the bends of the verify curve (SmolLM2 on the Zen 4 EPYC: a gamma-1 round 13% under its
        # timing, so the planner chose gamma 1 where plain decoding was 10% faster). The draft's reads
        # of each prompt are a per-token cost of speculating at all. The model above fills untimed widths.
        timed = {int(w): ms for w, ms in in_situ["round_ms"].items()}
        counts = {int(w): n for w, n in in_situ.get("rounds_by_width", {}).items()}
        costs.update(draft_ms=in_situ["draft_ms"], state_ms=in_situ["state_ms"], baseline_ms=in_situ["decode_ms"])
        costs["measured_cycle_ms"] = local_fit(timed, {w: counts.get(w, 1) for w in timed})
        costs["read_ms_per_token"] = in_situ.get("read_ms_per_token", 0.0)
    if calibration.get("tokens_per_round") and acceptance is calibration.get("acceptance"):
        # Greedy chains replayed on the calibration prompts: committed tokens per round per gamma
        # (acceptance passed in by the caller replaces them: its figure is then the model's).
        costs["measured_tokens"] = {int(g): n for g, n in calibration["tokens_per_round"].items()}
    return costmodel.sweep(range(0, top + 1), verify_ms=lambda n: verify[n], acceptance=acceptance, **costs)


def plot_verify_curve(profile_data: dict, path: str | Path, label: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = sorted(int(n) for n in profile_data["verify_ms"])
    ratio = [profile_data["verify_ms"][str(n)] / profile_data["decode_ms"] for n in positions]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(positions, ratio, marker="o", label=label or "verify(n) / decode(1)")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="roofline (weights read once)")
    ax.set_xlabel("verified positions n")
    ax.set_ylabel("verify ms / plain decode ms")
    ax.set_title("Target verification cost curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def seed_policy(policy, profile_data: dict) -> int:
    """Seed an ``AdaptiveGamma``'s batch-1 estimates from a calibrated profile: each gamma's planned
    cycle as its round time, the calibrated acceptance as evidence. Returns the gamma the profile
    predicts best (where the policy starts). ValueError/KeyError for a profile without calibration."""
    calibration = profile_data.get("calibration") or {}
    if not calibration.get("acceptance"):
        raise ValueError("it holds no calibration (make one with: verispec profile --calibrate N)")
    plans, _ = plan_from_profile(profile_data, max_gamma=max(policy.candidates))
    plans = [p for p in plans if p.gamma in policy.candidates]
    policy.seed({p.gamma: p.cycle_ms / 1e3 for p in plans}, calibration["acceptance"])
    return max(plans, key=lambda p: p.speedup).gamma


def load(path: str | Path) -> dict:
    """A profile JSON written by ``save``; OSError or ValueError where it is not one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "verify_ms" not in data:
        raise ValueError("not a verispec profile (no verify_ms)")
    return data


def load_option(path: str | None) -> dict | None:
    """The profile a command-line option names (None when not given); a one-line ``VerispecError`` for a
    file that cannot be read or is not a profile."""
    if not path:
        return None
    try:
        return load(path)
    except (OSError, ValueError) as err:
        raise VerispecError(f"cannot read profile {path!r}: {err}") from None


def save(profile_data: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile_data, indent=2) + "\n")
