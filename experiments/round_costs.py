"""Where a speculative round's time goes in ``SpecEngine``: median ms per round of drafting and of
verification, and drafts per round, over repeated generations of held-out-style prompts.

    OMP_NUM_THREADS=1 python experiments/round_costs.py --target tiny --temperature 1 --repeats 5

The first round of each generation (it reads the prompt) is left out. Compare the draft ms per draft
step with ``verispec profile``'s draft step, a forward in a tight loop.
"""

import argparse
import statistics

from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair

PROMPTS = ["def fibonacci(n):\n    ", "The three largest cities in Europe are", "Question: 17 + 25 = "]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pair = load_pair(args.target)
    spec = SpecConfig(gamma=args.gamma)
    engine = build_engine(pair, spec)
    sampling = SamplingParams(temperature=args.temperature)
    stop = StopRules(max_tokens=args.max_tokens, ignore_eos=True)
    draft_ms, verify_ms, drafted = [], [], []
    for repeat in range(args.repeats + 1):  # the first pass warms up
        for index, prompt in enumerate(PROMPTS):
            ids = pair.tokenizer.encode(prompt)
            result = engine.generate(ids, sampling, spec, stop, seed=repeat * len(PROMPTS) + index)
            if repeat:
                for record in result.stats.rounds[1:]:
                    draft_ms.append(1e3 * record.draft_s)
                    verify_ms.append(1e3 * record.verify_s)
                    drafted.append(record.drafted)
    draft, verify, steps = statistics.median(draft_ms), statistics.median(verify_ms), statistics.mean(drafted)
    print(f"{args.target}, temperature {args.temperature:g}, gamma {args.gamma}, {len(draft_ms)} rounds: "
          f"draft {draft:.2f} ms/round ({steps:.2f} drafts, {draft / steps:.2f} ms a draft), "
          f"verify {verify:.2f} ms/round (medians)")


if __name__ == "__main__":
    main()
