"""Native plain decoding vs transformers' ``generate``, and the engine's per-round overhead.

    python -m verispec.bench.core_speed --target DIR [--draft DIR] [--tokens 128] [--repeats 5]

Both decoders run greedily on the same checkpoint and prompt, alternating native / HF in each repeat
so that machine noise hits both alike; we report medians and the median of per-repeat ratios.
Engine overhead per round = round wall time minus the time spent inside model forward calls
(target and draft), measured by wrapping the models' ``forward``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair


def hf_plain_tokens_per_s(model, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt_ids])
    began = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
    elapsed = time.perf_counter() - began
    return tokens / elapsed, out[0, len(prompt_ids):].tolist()


class ForwardTimer:
    """Wraps a model's forward to sum the seconds spent inside it."""

    def __init__(self, model):
        self.seconds = 0.0
        self._forward = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - began


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--prompt", default="def quicksort(items):\n")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    pair = load_pair(args.target, args.draft)
    hf = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), dtype=torch.float32).eval()
    prompt_ids = pair.tokenizer.encode(args.prompt, add_special_tokens=False)
    greedy, stop = SamplingParams(temperature=0), StopRules(max_tokens=args.tokens, ignore_eos=True)
    plain = build_engine(pair, SpecConfig(method="none"))
    spec_config = SpecConfig(method="chain", gamma=args.gamma)
    spec = build_engine(pair, spec_config)
    plain.generate(prompt_ids, greedy, SpecConfig(method="none"), StopRules(max_tokens=8))  # warm-up
    hf_plain_tokens_per_s(hf, prompt_ids, 8)

    native_rates, hf_rates, ratios, overheads = [], [], [], []
    for _ in range(args.repeats):
        native = plain.generate(prompt_ids, greedy, SpecConfig(method="none"), stop)
        hf_rate, hf_tokens = hf_plain_tokens_per_s(hf, prompt_ids, args.tokens)
        if hf_tokens != native.tokens:
            print("warning: native and HF greedy outputs differ (float near-ties?)")
        native_rates.append(native.stats.tokens_per_s)
        hf_rates.append(hf_rate)
        ratios.append(native.stats.tokens_per_s / hf_rate)
        target_timer, draft_timer = ForwardTimer(pair.target), ForwardTimer(pair.draft)
        try:
            result = spec.generate(prompt_ids, greedy, spec_config, stop)
        finally:
            del pair.target.forward, pair.draft.forward  # restore the class method
        in_rounds = sum(r.total_s for r in result.stats.rounds)
        forward_in_rounds = target_timer.seconds + draft_timer.seconds - result.stats.prefill_s
        overheads.append(1e3 * (in_rounds - forward_in_rounds) / len(result.stats.rounds))
    report = {
        "target": str(pair.target_dir), "tokens": args.tokens, "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "native_plain_tokens_per_s": statistics.median(native_rates),
        "hf_generate_tokens_per_s": statistics.median(hf_rates),
        "native_over_hf": statistics.median(ratios),
        "engine_overhead_ms_per_round": statistics.median(overheads),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
