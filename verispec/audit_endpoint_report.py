"""What an endpoint audit finds: ``PromptResult`` per prompt, ``EndpointReport`` over all (verdict, exit
status, JSON via ``as_dict``) and its text form (``format_report``). Re-exported by
``verispec.audit_endpoint``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from verispec.audit_report import prompt_label
from verispec.config import SamplingParams
from verispec.two_sample import TwoSample

EXIT_CODES = {"pass": 0, "FAIL": 1, "inconclusive": 3}


@dataclass
class PromptResult:
    prompt: str | None
    prompt_ids: list[int] | None
    test: TwoSample
    finish: dict  # the endpoint's finish reasons and their counts
    reference_finish: dict
    top: list  # the most common texts: [text, count, reference count]

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "prompt_ids": self.prompt_ids, **asdict(self.test),
                "conclusive": self.test.conclusive, "finish_reasons": self.finish,
                "reference_finish_reasons": self.reference_finish, "top_texts": self.top}


@dataclass
class EndpointReport:
    verdict: str  # "pass", "FAIL" or "inconclusive"
    p_value: float  # Bonferroni over the prompts tested
    tv: float  # mean over prompts
    noise_floor: float  # mean over prompts
    alpha: float
    samples: int
    reference_samples: int
    tokens: int
    seed: int
    endpoint: dict  # url, model
    reference: dict  # url and model, or target
    sampling: SamplingParams
    prompts: list[PromptResult]
    notes: list[str] = field(default_factory=list)
    reason: str | None = None  # why inconclusive, or why FAIL when the logprob check failed
    logprobs: dict | None = None  # logprob_check's result, where the servers reported logprobs

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def as_dict(self) -> dict:
        s = self.sampling
        sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                    "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                    "repetition_penalty": s.repetition_penalty}
        return {"verdict": self.verdict, "p_value": self.p_value, "tv": self.tv, "noise_floor": self.noise_floor,
                "alpha": self.alpha, "samples": self.samples, "reference_samples": self.reference_samples,
                "tokens": self.tokens, "seed": self.seed, "endpoint": self.endpoint, "reference": self.reference,
                "sampling": sampling, "prompts": [p.as_dict() for p in self.prompts], "notes": self.notes,
                "reason": self.reason, "logprobs": self.logprobs}


def format_report(report: EndpointReport) -> str:
    s = report.sampling
    reference = report.reference.get("url") or f"local target {report.reference.get('target')}"
    lines = [f"endpoint audit: {report.endpoint['url']} (model {report.endpoint['model']}) against {reference}"
             + (f" (model {report.reference['model']})" if report.reference.get("model") else ""),
             f"temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}, min-p {s.min_p:g}; n = "
             f"{report.tokens} tokens, N = {report.samples} (reference {report.reference_samples}) per prompt, "
             f"seed {report.seed}",
             f"{'prompt':<24} {'texts':>6} {'cells':>6} {'coverage':>8} {'TV':>7} {'floor':>7} {'chi2/dof':>13} "
             f"{'p-value':>9}"]
    for item in report.prompts:
        t = item.test
        label = prompt_label(item.prompt, item.prompt_ids)
        lines.append(f"{label:<24} {t.distinct:>6} {t.cells:>6} {t.coverage:>8.2f} {t.tv:>7.4f} {t.noise_floor:>7.4f} "
                     f"{f'{t.chi_square:.1f}/{t.dof}':>13} {t.p_value:>9.3g}")
    lines += [f"note: {note}" for note in report.notes]
    if report.logprobs is not None:
        check = report.logprobs
        against = (f", up to {check['max_difference']:.3g} from the reference's over {check['common']} sequences"
                   if check["max_difference"] is not None else "")
        lines.append(f"logprobs: {'agree' if check['agree'] else 'DISAGREE'} (a token sequence's summed logprobs vary "
                     f"by up to {check['max_spread']:.3g} nats between its samples{against}; tolerance "
                     f"{check['tolerance']:g})")
    tail = (f"p = {report.p_value:.3g} {'<' if report.verdict == 'FAIL' else '>='} alpha {report.alpha:g}, Bonferroni "
            f"over {len(report.prompts)} prompt(s); TV {report.tv:.4f} vs noise floor {report.noise_floor:.4f}")
    if report.verdict == "inconclusive":
        tail = f"{report.reason}; {tail}"
    elif report.verdict == "FAIL" and report.reason:
        tail = report.reason
    lines.append(f"verdict: {report.verdict}  ({tail})")
    return "\n".join(lines)
