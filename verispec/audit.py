"""Lossless audit: does speculative decoding sample exactly the target's distribution on *your* pair?

    verispec audit --target T --draft D --method chain --temperature 0.8 --top-p 0.9 \\
        --prompt "def add(a, b):" --tokens 4 --samples 2000 --seed 1

Per prompt:

1. Draw N continuations of n tokens with speculative decoding (max_tokens n, EOS ignored), each with its
   own seed derived from --seed, and count how often each distinct sequence occurs (see "How the
   continuations are drawn" below).
2. Score every observed sequence exactly with the target alone: teacher forcing over prompt + sequence
   as one fresh prefill in a new cache (none of the engine's incremental, rollback, compaction or
   draft-reuse paths), one batched forward per chunk of distinct (n-1)-token prefixes, the same sampling
   transform (``logits_to_probs``) at each position, and the product of the chosen tokens'
   probabilities. What the observed sequences leave over is the unseen mass U = 1 - sum p.
3. Compare the counts c with N p:
   - Pearson chi-square over the observed sequences with expected count N p >= 5, plus one "rest" cell
     for every other sequence (the unseen mass included); the smallest cells join the rest until its
     expected count is >= 5. dof = cells - 1, p-value = P(chi2_dof >= X^2). A sampled sequence the
     target gives probability 0 is an outright failure (p-value 0).
   - TV = 1/2 (sum_observed |c/N - p| + U), the total-variation distance between the empirical and exact
     distributions (unseen sequences have frequency 0, so together they add exactly U).
   - noise floor = E[TV] for an exact sampler at this N: 1/2 sum_observed E|Bin(N, p)/N - p| (de
     Moivre's closed form) + U (a sequence too rare to be seen contributes its p). Treating the unseen
     sequences as individually rare slightly overstates the floor.
4. Verdict "pass" if the p-value >= alpha (default 1e-3), else "FAIL". With k prompts the p-value is
   Bonferroni's min(1, k * min_i p_i); ``tv`` and ``noise_floor`` are averages over the prompts.

Worked example (n = 1, three tokens, N = 100). Exact p = (A 0.5, B 0.3, C 0.2), counts (45, 38, 17):

    TV          = 1/2 (|0.45 - 0.5| + |0.38 - 0.3| + |0.17 - 0.2|)       = 0.080, U = 0
    X^2         = 5^2 / 50 + 8^2 / 30 + 3^2 / 20                          = 3.083, dof 2
    p-value     = exp(-X^2 / 2) (chi-square with 2 dof)                   = 0.214  -> pass
    noise floor = 1/2 (0.0398 + 0.0364 + 0.0318)  (E|c/N - p| per cell)   = 0.054

so a TV of 0.08, 1.5 times the floor, is ordinary noise at N = 100. The known-broken verifiers in
tests/test_audit.py (resampling from p after a rejection, a q that misses top-p, a tree verifier that
skips duplicate siblings) put TV 0.05-0.09 above the floor on a 4-token pair at n = 3 and FAIL at
N = 600-1200 (p < 1e-4); a bias much smaller than the noise floor needs proportionally more samples.

What the audit can see. The engine samples the first token at prefill and drafts at most
``max_tokens - generated - 1`` tokens per round, so an n-token audit verifies at most n - 2 chain draft
positions: n >= 3 is needed to exercise the verifier at all, n >= gamma + 2 to reach every draft
position (a tree is verified whole, but only n - 1 of its levels decide the output). The report counts
the draft positions verified and accepted and adds a note when none were. The number of possible
sequences grows as V^n, so on a large vocabulary a short n keeps the cells well filled. At temperature 0
the output is deterministic and the audit checks that speculation follows the argmax path.

How the continuations are drawn. The command runs them through the batched engine behind serve
(``BatchEngine``), --rows at once (default 64): one request per seed, a finished request's row refilled
with the next seed before the next round, its tokens and draft positions verified and accepted taken
from its last event. Every request of a prompt repeats the same prefill, so the engine's target computes
it once per prompt and replays its logits and keys/values (``SharedPrefill``). Each row samples from a
generator of its own, seeded as ``SpecEngine.generate`` seeds one, and the counts are made in seed order,
so the same --seed gives the same report. A seed's continuation is also the one SpecEngine draws alone
wherever a pass over many rows computes the same floats as a pass over one: on the test pairs in
tests/test_audit.py for every method, and on the embedded pair with a native-weight draft. Not with the
default int8 draft weights: a draft pass of more than ``kernels.INT8_ROWS`` rows multiplies with the
bf16 weights, so a row's q, and then its tokens, depend on how many rows drafted with it. The
distribution does not: the verifier is given the q each draft was drawn from. In either engine two
settings make a continuation depend on more than its seed: a dynamic tree (``--tree dynamic:D``) takes
its shape from what its drafter's earlier requests accepted (in the batched engine each row's drafter
has a history of its own), and the adaptive gamma policy follows measured wall time. A grammar
constraint is copied per request (a constraint follows one request); penalties and the sampling
transform are per request already. ``SpecEngine`` draws them one at a time instead with --rows 1
(``audit_engine``). Compressed-attention and transformers-backed targets run their rows' passes one
after another in the batched engine (``verispec.batch.row_loop``), and a draft with another tokenizer
drafts per row through its vocabulary bridge. ``run_audit`` takes either engine.

Presets: ``--thorough`` means N = 10000 per prompt over the four built-in prompts (explicit --samples,
--tokens and --prompt still win): 40000 generations, minutes on a small pair, about an hour for SmolLM2
on one Zen 4 core (80 minutes with --rows 1).
Exit status: 0 pass, 1 FAIL, 2 bad input (one-line message).

``--endpoint URL`` audits a running OpenAI-compatible server instead, as a black box against a second
endpoint or a local model (two-sample test over texts; exit 3 when inconclusive): verispec/audit_endpoint.py.

This module samples, scores and runs the command; the statistics are in verispec/audit_stats.py, the
config and report types and the text report in verispec/audit_report.py (both re-exported here).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections import Counter
from typing import Sequence

import numpy as np

# the config, report and statistics names are re-exported: verispec.audit is their public path
from verispec.audit_report import (DEFAULT_ALPHA, DEFAULT_SAMPLES, DEFAULT_TOKENS, MAX_TOKENS,  # noqa: F401
                                   MIN_SAMPLES, AuditConfig, AuditReport, PromptAudit, format_report,
                                   prompt_label)
from verispec.audit_engine import DEFAULT_ROWS, SharedPrefill, audit_engine  # noqa: F401
from verispec.audit_stats import (MIN_EXPECTED_COUNT, Fit, binomial_mean_abs_deviation,  # noqa: F401
                                  chi_square_pvalue, goodness_of_fit, pearson_with_rest)
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.errors import VerispecError

THOROUGH_SAMPLES = 10_000
CHAT_PREFIX = "chat: "  # a built-in prompt sent as a user message through the target's chat template
BUILTIN_PROMPTS = (
    "def fibonacci(n):\n",
    "The capital of France is",
    CHAT_PREFIX + "What is speculative decoding?",
    "one two three one two three one two",
)
LOGITS_PER_FORWARD = 1 << 24  # teacher-forcing chunk size: rows * positions * vocabulary floats


# ---- the audit ---------------------------------------------------------------------------------------


def run_audit(engine, prompts: Sequence[Sequence[int]], sampling: SamplingParams, spec: SpecConfig,
              audit: AuditConfig = AuditConfig(), progress: bool = False,
              prompt_texts: Sequence[str] | None = None) -> AuditReport:
    """Audit ``engine`` on token-id prompts: a ``BatchEngine`` (built for ``spec``; ``audit_engine``
    builds the CLI's) runs its rows' generations at once, a ``SpecEngine`` one after another."""
    from tqdm import tqdm

    if not prompts:
        raise VerispecError("give at least one prompt")
    vocab = engine.target.config.vocab_size
    for ids in prompts:
        if any(not 0 <= t < vocab for t in ids):
            raise VerispecError(f"prompt token ids must be in 0..{vocab - 1} for this target, got {list(ids)}")
    from verispec.batch.row_loop import RowLoop

    scored = engine.target.model if isinstance(engine.target, RowLoop) else engine.target  # the model itself
    results = []
    with tqdm(total=len(prompts) * audit.samples, desc="audit", unit="seq", file=sys.stderr,
              disable=not progress, mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
        for index, ids in enumerate(prompts):
            seeds = sample_seeds(audit.seed, index, audit.samples)
            counts, drafted, accepted = sample_continuations(engine, list(ids), sampling, spec, audit.tokens,
                                                             seeds, bar.update)
            probs = sequence_probabilities(scored, list(ids), list(counts), sampling)
            text = prompt_texts[index] if prompt_texts is not None else None
            results.append(PromptAudit(list(ids), goodness_of_fit(counts, probs), drafted, accepted, text))
    p_value = min(1.0, len(results) * min(r.fit.p_value for r in results))
    notes = []
    if spec.enabled and not any(r.drafted for r in results):
        notes.append("no draft was verified, so only plain sampling was audited: the first token comes from "
                     "prefill and the last round has nothing left to draft; use --tokens >= 3")
    if getattr(spec, "gamma_policy", "fixed") == "adaptive":
        notes.append("the adaptive gamma policy picks gamma from measured wall time, so a rerun with the same "
                     "seed may differ token for token (the distribution it is audited for does not change)")
    if any(r.fit.impossible for r in results):
        notes.append("speculation produced sequences the target gives probability 0 (a filter boundary "
                     "within float noise would do this too)")
    return AuditReport("pass" if p_value >= audit.alpha else "FAIL", p_value,
                       float(np.mean([r.fit.tv for r in results])),
                       float(np.mean([r.fit.noise_floor for r in results])),
                       audit, sampling, spec, results, notes)


def sample_seeds(seed: int, prompt_index: int, count: int) -> list[int]:
    """``count`` distinct-with-overwhelming-probability 64-bit generation seeds for one prompt."""
    state = np.random.SeedSequence([seed, prompt_index]).generate_state(count, dtype=np.uint64)
    return [int(s) for s in state]


def sample_continuations(engine, prompt_ids: list[int], sampling: SamplingParams, spec: SpecConfig,
                         tokens: int, seeds: Sequence[int], advance=lambda n: None) -> tuple[Counter, int, int]:
    """Counts of the ``tokens``-long continuations, plus draft positions verified and accepted: one
    generation per seed, through a ``BatchEngine``'s rows (``sample_batched``; ``spec`` is the one it
    was built for) or one after another through a ``SpecEngine``. ``advance(1)`` after each."""
    from verispec.batch import BatchEngine

    if isinstance(engine, BatchEngine):
        return sample_batched(engine, prompt_ids, sampling, tokens, seeds, advance)
    stop = StopRules(max_tokens=tokens, ignore_eos=True)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        result = engine.generate(prompt_ids, sampling, spec, stop, seed=seed)
        counts[tuple(result.tokens)] += 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
        advance(1)
    return counts, drafted, accepted


def sample_batched(engine, prompt_ids: list[int], sampling: SamplingParams, tokens: int, seeds: Sequence[int],
                   advance=lambda n: None) -> tuple[Counter, int, int]:
    """``sample_continuations`` through an idle ``BatchEngine``: one request per seed (request id = its
    index), added while the engine has a free row, so finished rows are refilled between rounds. Each
    row draws from its own generator seeded like ``SpecEngine.generate``, so a seed's sequence does not
    depend on the other rows (up to float differences between batch sizes; see the module docstring).
    Counts are made in seed order, as the sequential path makes them."""
    from verispec.batch import BatchRequest

    if engine.active:
        raise VerispecError("the audit needs an idle batched engine (no running requests)")
    stop = StopRules(max_tokens=tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    finished: list[tuple[int, ...] | None] = [None] * len(seeds)
    drafted = accepted = 0
    waiting = iter(enumerate(seeds))
    index, seed = next(waiting, (None, None))
    while index is not None or engine.active:
        events = []
        while index is not None and engine.has_capacity:
            events += engine.add(BatchRequest(str(index), list(prompt_ids), _own_constraint(sampling), stop, seed=seed))
            index, seed = next(waiting, (None, None))
        events += engine.step()
        for event in events:
            sequence = outputs.setdefault(event.request_id, [])
            sequence += event.tokens
            if event.finished:
                finished[int(event.request_id)] = tuple(outputs.pop(event.request_id))
                drafted += event.stats.drafted
                accepted += event.stats.accepted
                advance(1)
    return Counter(finished), drafted, accepted


def _own_constraint(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with a copy of its grammar constraint, if it has one: a constraint follows one
    request at a time (``Guide.for_request`` resets it), and batched requests run together."""
    from verispec.grammar import Constraint
    from verispec.guide import Guide

    constraint = sampling.guide.constraint if isinstance(sampling.guide, Guide) else sampling.guide
    if constraint is None:
        return sampling
    return dataclasses.replace(sampling, guide=Constraint(constraint.matcher.deep_copy(), constraint.vocab_size,
                                                          constraint.eos_ids, constraint.spec))


def sequence_probabilities(target, prompt_ids: list[int], sequences: list[tuple[int, ...]],
                           sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """The target's exact probability of each n-token sequence after ``prompt_ids``, by teacher forcing.

    Row b of a chunk is prompt + prefix_b (the sequences' distinct first n - 1 tokens); its last n
    positions give the n next-token distributions of every sequence sharing that prefix.
    """
    import torch

    from verispec.guide import Guide
    from verispec.sampling import logits_to_probs

    if not sequences:
        return {}
    length = len(sequences[0])
    by_prefix: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for seq in sequences:
        assert len(seq) == length, "all sequences must have the same length"
        by_prefix.setdefault(seq[:-1], []).append(seq)
    prefixes = list(by_prefix)
    guide = Guide.for_request(sampling, prompt_ids, target.config.vocab_size)
    width = len(prompt_ids) + length - 1
    rows = max(1, LOGITS_PER_FORWARD // (width * target.config.vocab_size))
    device = _device_of(target)
    exact = {}
    with torch.inference_mode():
        for start in range(0, len(prefixes), rows):
            chunk = prefixes[start:start + rows]
            ids = torch.tensor([prompt_ids + list(prefix) for prefix in chunk], device=device)  # (B, width)
            if getattr(target, "batched_cache", True):
                logits = target.forward(ids, target.new_cache(len(chunk), width))
            else:  # one-sequence caches (compressed attention): score whole rows from position 0
                logits = target.train_forward(ids)[0]
            logits = logits[:, len(prompt_ids) - 1:]  # (B, n, V)
            if guide is not None:  # each row under the grammar's masks and the penalties along its own prefix
                logits = torch.stack([guide.path_masks(list(prefix))[0].apply(logits[row].cpu())
                                      for row, prefix in enumerate(chunk)])
            probs = logits_to_probs(logits, sampling).double().cpu()  # (B, n, V)
            for row, prefix in enumerate(chunk):
                head = math.prod(float(probs[row, i, token]) for i, token in enumerate(prefix))
                for seq in by_prefix[prefix]:
                    exact[seq] = head * float(probs[row, length - 1, seq[-1]])
    return exact


def _device_of(model):
    device = getattr(model, "device", None)  # the transformers adapter says; a native model is a Module
    return device if device is not None else next(model.parameters()).device


# ---- command line ------------------------------------------------------------------------------------


def add_parser(commands) -> None:
    """Register ``verispec audit`` on the CLI's subparsers."""
    from verispec import options

    audit = commands.add_parser(
        "audit", help="certify that speculative decoding samples exactly the target's distribution",
        description="Sample N continuations of n tokens per prompt with speculative decoding, score every "
                    "observed sequence exactly with the target alone, and test the counts (chi-square, "
                    "total variation against its noise floor). Exit status 0 pass, 1 FAIL, 2 bad input. "
                    "Unlike generate, audit samples at temperature 1 by default. See verispec/audit.py "
                    "for the statistics and a worked example. With --endpoint URL: a black-box audit of a "
                    "running OpenAI-compatible server against --reference URL or --target (exit 3: "
                    "inconclusive); see verispec/audit_endpoint.py.")
    options.add_model_options(audit)
    options.add_threads_option(audit)
    options.add_sampling_options(audit, temperature=1.0)  # greedy output is deterministic: nothing to audit
    options.add_spec_options(audit)
    options.add_grammar_options(audit)
    audit.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                       help="prompt text (repeatable); default: the first built-in prompt")
    audit.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                       help="prompt as comma-separated token ids (repeatable)")
    audit.add_argument("--tokens", type=int, default=None,
                       help=f"n, tokens per continuation, 1..{MAX_TOKENS} (default {DEFAULT_TOKENS}); n >= "
                            "gamma + 2 reaches every chain draft position")
    audit.add_argument("--samples", type=int, default=None,
                       help=f"N, continuations per prompt, >= {MIN_SAMPLES} (default {DEFAULT_SAMPLES})")
    audit.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                       help=f"fail when the combined p-value is below this (default {DEFAULT_ALPHA:g})")
    audit.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                       help=f"generations run at once in the batched engine (default {DEFAULT_ROWS}); 1 runs "
                            "them one at a time (SpecEngine)")
    audit.add_argument("--thorough", action="store_true",
                       help=f"preset: N = {THOROUGH_SAMPLES} over all {len(BUILTIN_PROMPTS)} built-in prompts")
    audit.add_argument("--json", action="store_true",
                       help="print one JSON object: verdict, p_value, tv, noise_floor, per-prompt details")
    from verispec.audit_endpoint import add_options as add_endpoint_options

    add_endpoint_options(audit)
    audit.set_defaults(run=run_command, chain_policy="fixed")  # an audit's chains draft --gamma every round


def run_command(args) -> int:
    if args.endpoint is not None or args.reference is not None:  # the black-box audit of a server
        from verispec.audit_endpoint import run_endpoint_command

        return run_endpoint_command(args)
    from verispec import options
    from verispec.loading import check_model_args, encode_prompt, eos_ids, load_pair, resolve_draft_vocab

    if args.rows < 1:
        raise VerispecError(f"--rows must be >= 1, got {args.rows}")
    default_samples = THOROUGH_SAMPLES if args.thorough else DEFAULT_SAMPLES
    config = AuditConfig(tokens=DEFAULT_TOKENS if args.tokens is None else args.tokens,
                         samples=default_samples if args.samples is None else args.samples,
                         seed=args.seed, alpha=args.alpha)
    sampling = options.sampling_from_args(args)
    spec = options.spec_from_args(args)
    grammar = options.grammar_from_args(args)
    id_prompts = [_parse_ids(text) for text in args.prompt_ids]
    needs_draft = spec.enabled and spec.drafter == "model"
    check_model_args(args.target, args.draft, needs_draft)
    pair = load_pair(args.target, args.draft, device=args.device, need_draft=needs_draft, backend=args.backend,
                     draft_weights=args.draft_weights, **options.eagle_args(args, spec))
    if needs_draft:  # the draft as generate and serve run it
        spec = dataclasses.replace(spec, draft_vocab=resolve_draft_vocab(pair, args.draft_vocab))
    texts = list(args.prompt)
    if not texts and not id_prompts:
        texts = list(BUILTIN_PROMPTS if args.thorough else BUILTIN_PROMPTS[:1])
    prompts = [encode_prompt(pair.tokenizer, text.removeprefix(CHAT_PREFIX), chat=text.startswith(CHAT_PREFIX))
               for text in texts] + id_prompts
    labels = texts + [None] * len(id_prompts)
    sampling = options.guided(sampling, grammar, pair, eos_ids(pair.tokenizer, pair.target))
    engine = audit_engine(pair, spec, args.rows, max(map(len, prompts)) + config.tokens)
    report = run_audit(engine, prompts, sampling, spec, config, progress=True, prompt_texts=labels)
    print(json.dumps(report.as_dict()) if args.json else format_report(report))
    return 0 if report.passed else 1


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise VerispecError(f"--prompt-ids must be comma-separated token ids, got {text!r}") from None
    if not ids:
        raise VerispecError("--prompt-ids is empty; give at least one token id")
    return ids
