"""What an audit is asked (``AuditConfig``: n, N, seed, alpha, their bounds and defaults) and what it
finds (``PromptAudit`` per prompt, ``AuditReport`` over all), as JSON (``as_dict``) and as text
(``format_report``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from verispec.audit_stats import Fit
from verispec.config import SamplingParams, SpecConfig
from verispec.errors import VerispecError

MIN_SAMPLES, MAX_TOKENS = 50, 8
DEFAULT_ALPHA = 1e-3
DEFAULT_SAMPLES, DEFAULT_TOKENS = 1000, 4


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
