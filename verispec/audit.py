"""Lossless audit: does speculative decoding sample exactly the target's distribution on *your* pair?

    verispec audit --target T --draft D --method chain --temperature 0.8 --top-p 0.9 \\
        --prompt "def add(a, b):" --tokens 4 --samples 2000 --seed 1

Per prompt:

1. Draw N continuations of n tokens with speculative decoding (max_tokens n, EOS ignored), each with its
   own seed derived from --seed, and count how often each distinct sequence occurs.
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

Presets: ``--thorough`` means N = 10000 per prompt over the four built-in prompts (explicit --samples,
--tokens and --prompt still win): 40000 generations, so expect minutes on a small pair.
Exit status: 0 pass, 1 FAIL, 2 bad input (one-line message).

``--endpoint URL`` audits a running OpenAI-compatible server instead, as a black box against a second
endpoint or a local model (two-sample test over texts; exit 3 when inconclusive): verispec/audit_endpoint.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.errors import VerispecError

MIN_EXPECTED_COUNT = 5.0
MIN_SAMPLES, MAX_TOKENS = 50, 8
DEFAULT_ALPHA = 1e-3
DEFAULT_SAMPLES, DEFAULT_TOKENS = 1000, 4
THOROUGH_SAMPLES = 10_000
CHAT_PREFIX = "chat: "  # a built-in prompt sent as a user message through the target's chat template
BUILTIN_PROMPTS = (
    "def fibonacci(n):\n",
    "The capital of France is",
    CHAT_PREFIX + "What is speculative decoding?",
    "one two three one two three one two",
)
LOGITS_PER_FORWARD = 1 << 24  # teacher-forcing chunk size: rows * positions * vocabulary floats


@dataclass(frozen=True)
class AuditConfig:
    """n tokens per continuation, N samples per prompt, the base seed, the significance level."""

    tokens: int = DEFAULT_TOKENS
    samples: int = DEFAULT_SAMPLES
    seed: int = 0
    alpha: float = DEFAULT_ALPHA

    def __post_init__(self):
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise VerispecError(f"--tokens must be in 1..{MAX_TOKENS} (the audit scores every sequence of that "
                                f"length exactly), got {self.tokens}")
        if self.samples < MIN_SAMPLES:
            raise VerispecError(f"--samples must be >= {MIN_SAMPLES} for a meaningful test, got {self.samples}")
        if not 0 < self.alpha < 1:
            raise VerispecError(f"--alpha must be in (0, 1), got {self.alpha}")
        if self.seed < 0:
            raise VerispecError(f"--seed must be >= 0 for an audit, got {self.seed}")


@dataclass(frozen=True)
class Fit:
    """How well counts of sequences follow their exact probabilities (see the module docstring)."""

    samples: int
    distinct: int  # distinct sequences observed
    tv: float
    noise_floor: float
    chi_square: float
    dof: int
    p_value: float
    unseen_mass: float
    impossible: int  # samples of sequences the target gives probability 0


@dataclass
class PromptAudit:
    prompt_ids: list[int]
    fit: Fit
    drafted: int  # draft positions verified, summed over all samples
    accepted: int
    prompt_text: str | None = None

    def as_dict(self) -> dict:
        return {"prompt": self.prompt_text, "prompt_ids": self.prompt_ids, **asdict(self.fit),
                "drafted": self.drafted, "accepted": self.accepted}


@dataclass
class AuditReport:
    verdict: str  # "pass" or "FAIL"
    p_value: float  # Bonferroni-combined over prompts
    tv: float  # mean over prompts
    noise_floor: float  # mean over prompts
    audit: AuditConfig
    sampling: SamplingParams
    spec: SpecConfig
    prompts: list[PromptAudit]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def as_dict(self) -> dict:
        spec = {k: v for k, v in asdict(self.spec).items() if k != "extra"}
        guide = self.sampling.guide
        sampling = {"temperature": self.sampling.temperature, "top_k": self.sampling.top_k,
                    "top_p": self.sampling.top_p, "min_p": self.sampling.min_p,
                    "presence_penalty": self.sampling.presence_penalty,
                    "frequency_penalty": self.sampling.frequency_penalty,
                    "repetition_penalty": self.sampling.repetition_penalty,
                    "grammar": None if guide is None else {"kind": guide.spec.kind, "source": guide.spec.source}}
        return {"verdict": self.verdict, "p_value": self.p_value, "tv": self.tv, "noise_floor": self.noise_floor,
                "alpha": self.audit.alpha, "samples": self.audit.samples, "tokens": self.audit.tokens,
                "seed": self.audit.seed, "config": {"sampling": sampling, "spec": spec},
                "prompts": [p.as_dict() for p in self.prompts], "notes": self.notes}


# ---- the audit ---------------------------------------------------------------------------------------


def run_audit(engine, prompts: Sequence[Sequence[int]], sampling: SamplingParams, spec: SpecConfig,
              audit: AuditConfig = AuditConfig(), progress: bool = False,
              prompt_texts: Sequence[str] | None = None) -> AuditReport:
    """Audit ``engine`` (a SpecEngine: its target and drafter) on token-id prompts."""
    from tqdm import tqdm

    if not prompts:
        raise VerispecError("give at least one prompt")
    vocab = engine.target.config.vocab_size
    for ids in prompts:
        if any(not 0 <= t < vocab for t in ids):
            raise VerispecError(f"prompt token ids must be in 0..{vocab - 1} for this target, got {list(ids)}")
    results = []
    with tqdm(total=len(prompts) * audit.samples, desc="audit", unit="seq", file=sys.stderr,
              disable=not progress, mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
        for index, ids in enumerate(prompts):
            seeds = sample_seeds(audit.seed, index, audit.samples)
            counts, drafted, accepted = sample_continuations(engine, list(ids), sampling, spec, audit.tokens,
                                                             seeds, bar.update)
            probs = sequence_probabilities(engine.target, list(ids), list(counts), sampling)
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
    """Counts of the ``tokens``-long continuations, plus draft positions verified and accepted."""
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


# ---- statistics (pure) -----------------------------------------------------------------------------


def goodness_of_fit(counts: dict, probs: dict) -> Fit:
    """Chi-square, TV and noise floor of observed ``counts`` against exact ``probs`` (same keys)."""
    samples = sum(counts.values())
    cells = [(min(1.0, max(0.0, probs[key])), count) for key, count in counts.items()]
    unseen = max(0.0, 1.0 - sum(p for p, _ in cells))
    tv = 0.5 * (sum(abs(count / samples - p) for p, count in cells) + unseen)
    floor = 0.5 * sum(binomial_mean_abs_deviation(samples, p) for p, _ in cells) / samples + unseen
    impossible = sum(count for p, count in cells if p == 0)
    if impossible:
        return Fit(samples, len(cells), tv, floor, math.inf, 0, 0.0, unseen, impossible)
    statistic, dof = pearson_with_rest(cells, samples)
    return Fit(samples, len(cells), tv, floor, statistic, dof, chi_square_pvalue(statistic, dof), unseen, 0)


def pearson_with_rest(cells: list[tuple[float, int]], samples: int) -> tuple[float, int]:
    """X^2 and dof over cells (p, count) with expected count >= 5, plus a pooled rest cell."""
    big = sorted((c for c in cells if c[0] * samples >= MIN_EXPECTED_COUNT), reverse=True)
    rest_expected = samples * max(0.0, 1.0 - sum(p for p, _ in big))
    rest_observed = samples - sum(count for _, count in big)
    while big and rest_expected < MIN_EXPECTED_COUNT:  # keep the approximation valid for the rest cell
        p, count = big.pop()
        rest_expected += samples * p
        rest_observed += count
    statistic = sum((count - samples * p) ** 2 / (samples * p) for p, count in big)
    statistic += (rest_observed - rest_expected) ** 2 / rest_expected if rest_expected > 0 else 0.0
    return statistic, len(big)  # cells - 1: the big ones plus the rest


def chi_square_pvalue(statistic: float, dof: int) -> float:
    """P(chi2_dof >= statistic), the regularised upper incomplete gamma Q(dof/2, statistic/2).

    Closed forms for integer dof (y = statistic / 2): even dof = 2m: e^-y sum_{j<m} y^j / j!;
    odd dof = 2m + 1: erfc(sqrt y) + e^-y sum_{j<m} y^(j+1/2) / Gamma(j + 3/2). Terms are positive, so
    the sum has no cancellation; each is formed in log space so large y cannot overflow.
    """
    if dof <= 0 or statistic <= 0:
        return 1.0
    if math.isinf(statistic):
        return 0.0
    y = statistic / 2
    half, offset = divmod(dof, 2)
    shift = 0.5 if offset else 0.0
    total = sum(math.exp((j + shift) * math.log(y) - y - math.lgamma(j + shift + 1)) for j in range(half))
    if offset:
        total += math.erfc(math.sqrt(y))
    return min(1.0, total)


def binomial_mean_abs_deviation(n: int, p: float) -> float:
    """E|X - n p| for X ~ Binomial(n, p), de Moivre: 2 v C(n, v) p^v (1 - p)^(n - v + 1), v = floor(n p) + 1."""
    if p <= 0 or p >= 1:
        return 0.0
    v = math.floor(n * p) + 1
    if v > n:
        return 0.0
    log_value = (math.log(2 * v) + math.lgamma(n + 1) - math.lgamma(v + 1) - math.lgamma(n - v + 1)
                 + v * math.log(p) + (n - v + 1) * math.log1p(-p))
    return math.exp(log_value)


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
    audit.add_argument("--thorough", action="store_true",
                       help=f"preset: N = {THOROUGH_SAMPLES} over all {len(BUILTIN_PROMPTS)} built-in prompts")
    audit.add_argument("--json", action="store_true",
                       help="print one JSON object: verdict, p_value, tv, noise_floor, per-prompt details")
    from verispec.audit_endpoint import add_options as add_endpoint_options

    add_endpoint_options(audit)
    audit.set_defaults(run=run_command)


def run_command(args) -> int:
    if args.endpoint is not None or args.reference is not None:  # the black-box audit of a server
        from verispec.audit_endpoint import run_endpoint_command

        return run_endpoint_command(args)
    from verispec import options
    from verispec.loading import (build_engine, check_model_args, encode_prompt, eos_ids, load_pair,
                                  resolve_draft_vocab)

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
    pair = load_pair(args.target, args.draft, device=args.device, need_draft=needs_draft,
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
    report = run_audit(build_engine(pair, spec), prompts, sampling, spec, config, progress=True,
                       prompt_texts=labels)
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


def prompt_label(text: str | None, ids: list[int] | None) -> str:
    """A prompt as a report's first column: its text (or ids), cut to 24 characters."""
    label = repr(text) if text is not None else str(ids)
    return label if len(label) <= 24 else label[:21] + "..."


def format_report(report: AuditReport) -> str:
    sampling, spec, audit = report.sampling, report.spec, report.audit
    method = spec.method if spec.drafter == "model" or not spec.enabled else f"{spec.method} ({spec.drafter})"
    lines = [f"audit: {method}, temperature {sampling.temperature:g}, top-k {sampling.top_k}, "
             f"top-p {sampling.top_p:g}, min-p {sampling.min_p:g}; n = {audit.tokens} tokens, "
             f"N = {audit.samples} per prompt, seed {audit.seed}"
             + ("" if sampling.guide is None else f"; under a {sampling.guide.spec.kind.replace('_', ' ')}"),
             f"{'prompt':<24} {'distinct':>8} {'unseen':>7} {'TV':>7} {'floor':>7} {'chi2/dof':>13} "
             f"{'p-value':>9} {'accepted/drafted':>17}"]
    for item in report.prompts:
        fit = item.fit
        label = prompt_label(item.prompt_text, item.prompt_ids)
        chi = f"{fit.chi_square:.1f}/{fit.dof}"
        lines.append(f"{label:<24} {fit.distinct:>8} {fit.unseen_mass:>7.4f} {fit.tv:>7.4f} {fit.noise_floor:>7.4f} "
                     f"{chi:>13} {fit.p_value:>9.3g} {f'{item.accepted}/{item.drafted}':>17}")
    lines += [f"note: {note}" for note in report.notes]
    relation = ">=" if report.passed else "<"
    lines.append(f"verdict: {report.verdict}  (p = {report.p_value:.3g} {relation} alpha {audit.alpha:g}, "
                 f"Bonferroni over {len(report.prompts)} prompt(s); TV {report.tv:.4f} vs noise floor "
                 f"{report.noise_floor:.4f})")
    return "\n".join(lines)
