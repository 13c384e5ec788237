"""Quality on the same tasks, speculation off vs on, for SmolLM2-135M-Instruct and its shipped draft.

    python experiments/smollm2_quality.py --problems 24 --out docs/results/smollm2-quality.json

- arithmetic: held-out synthetic word problems asked through the chat template ("... Reply with the final
  number."); correct iff the last integer of the reply equals the reference answer;
- code: held-out standard-library function signatures + docstrings; valid iff the body (up to the first
  dedent) is not blank and prompt + body parses (``bench.checks.code_valid``);
- completion rate: the share of answers that ended on their own (EOS or a stop) within ``--tokens``.

Each at temperature 0 and at 0.7 (seeded; spec on and off draw differently, so sampled rows agree in
distribution, not token for token), speculation off and chain gamma 4 with the shipped draft. Greedy rows
must match exactly (lossless); sampled rows within noise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from verispec.bench.checks import code_valid
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, encode_prompt, eos_ids, load_pair, resolve_draft_vocab
from verispec.train import corpus, synthetic_math

NUMBER = re.compile(r"-?\d+")
CODE_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")


def tasks(count: int):
    math = []
    for problem in corpus.math_problems("heldout")[:count]:
        question = synthetic_math.question_prompt(problem).removeprefix("Question: ").removesuffix("Answer:").strip()
        reference = NUMBER.findall(problem[len(synthetic_math.question_prompt(problem)):])[-1]
        math.append((question + " Reply with the final number.", reference))
    code = corpus.heldout_prompts("code", count)
    return math, code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=24, help="arithmetic problems and code prompts, each")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    pair = load_pair("smollm2")
    vocab = resolve_draft_vocab(pair, "auto")
    math, code = tasks(args.problems)
    eos = tuple(eos_ids(pair.tokenizer, pair.target))
    settings = {"greedy": SamplingParams(temperature=0), "t0.7": SamplingParams(temperature=0.7)}
    specs = {"off": SpecConfig(method="none"), "chain g4": SpecConfig(method="chain", gamma=4, draft_vocab=vocab)}
    rows, outputs = [], {}
    for spec_name, spec in specs.items():
        engine = build_engine(pair, spec)
        for setting, sampling in settings.items():
            correct = valid = finished = 0
            texts = []
            for index, (question, reference) in enumerate(math):
                ids = encode_prompt(pair.tokenizer, question, chat=True)
                result = engine.generate(ids, sampling, spec, StopRules(max_tokens=args.tokens, eos_ids=eos),
                                         seed=index)
                text = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
                numbers = NUMBER.findall(text)
                correct += bool(numbers) and numbers[-1] == reference
                finished += result.stats.finish_reason != "length"
                texts.append(result.tokens)
            for index, prompt in enumerate(code):
                ids = encode_prompt(pair.tokenizer, prompt, chat=False)
                stop = StopRules(max_tokens=args.tokens, eos_ids=eos, stop_strings=CODE_STOPS)
                result = engine.generate(ids, sampling, spec, stop, seed=1000 + index)
                text = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
                if result.stop_text_index is not None:
                    text = text[:result.stop_text_index]
                valid += code_valid(prompt, text)
                finished += result.stats.finish_reason != "length"
                texts.append(result.tokens)
            outputs[(spec_name, setting)] = texts
            rows.append({"spec": spec_name, "sampling": setting, "math_accuracy": correct / len(math),
                         "code_valid": valid / len(code), "completion_rate": finished / (len(math) + len(code))})
            print(json.dumps(rows[-1]), file=sys.stderr)
    identical = outputs[("off", "greedy")] == outputs[("chain g4", "greedy")]
    record = {"command": "python experiments/smollm2_quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "problems": len(math), "code_prompts": len(code), "max_tokens": args.tokens, "rows": rows,
              "greedy_outputs_identical": identical}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
