"""Compare the two grammar engines on the default target's tokenizer: compile time, per-token mask
time, consume and rollback, on a JSON schema and a regex, replaying a valid answer token by token.

    python experiments/grammar_engines.py [--target smollm2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
                     "address": {"city": "London", "zip": "W1"}}, separators=(",", ":"))
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,4})?"
REGEX_ANSWER = "415-555-0199 ext. 12"


def llguidance_engine(tokenizer, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_(kind, text):
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
                   if kind == "json" else llguidance.LLMatcher.grammar_from_regex(text))
        return grammar

    def matcher(grammar):
        return llguidance.LLMatcher(info, grammar)

    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def mask(m):
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
        return bitmask

    return compile_, matcher, mask, lambda m, t: m.consume_token(t), lambda m, n: m.rollback(n)


def xgrammar_engine(tokenizer, vocab):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_(kind, text):
        return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":")) if kind == "json" else compiler.compile_regex(text)

    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def mask(m):
        m.fill_next_token_bitmask(bitmask)
        return bitmask

    return (compile_, lambda g: xgr.GrammarMatcher(g, max_rollback_tokens=16), mask,
            lambda m, t: m.accept_token(t), lambda m, n: m.rollback(n))


def measure(name, engine, tokenizer, vocab, repeats):
    t0 = time.perf_counter()
    compile_, matcher, mask, consume, rollback = engine(tokenizer, vocab)
    setup_s = time.perf_counter() - t0
    rows = {"engine": name, "tokenizer_setup_s": round(setup_s, 3)}
    for kind, text, answer in (("json", json.dumps(SCHEMA), ANSWER), ("regex", REGEX, REGEX_ANSWER)):
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        compile_s, mask_ms, rollback_ms = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            grammar = compile_(kind, text)
            m = matcher(grammar)
            compile_s.append(time.perf_counter() - t0)
            masks = 0.0
            for token in tokens:
                t0 = time.perf_counter()
                mask(m)
                masks += time.perf_counter() - t0
                assert consume(m, token), (name, kind, token)
            mask_ms.append(1e3 * masks / len(tokens))
            t0 = time.perf_counter()
            rollback(m, 4)
            for token in tokens[-4:]:
                consume(m, token)
            rollback_ms.append(1e3 * (time.perf_counter() - t0))
        rows[kind] = {"answer_tokens": len(tokens), "compile_s": round(statistics.median(compile_s), 4),
                      "mask_ms_per_token": round(statistics.median(mask_ms), 4),
                      "rollback4_and_replay_ms": round(statistics.median(rollback_ms), 4)}
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from verispec.loading import load_target_and_tokenizer

    torch.set_num_threads(1)
    model, tokenizer = load_target_and_tokenizer(args.target)
    vocab = model.config.vocab_size
    out = {"cpu": platform.processor() or platform.machine(), "target": args.target, "vocab": vocab, "engines": []}
    for name, engine in (("llguidance", llguidance_engine), ("xgrammar", xgrammar_engine)):
        try:
            out["engines"].append(measure(name, engine, tokenizer, vocab, args.repeats))
        except ImportError as err:
            out["engines"].append({"engine": name, "error": str(err)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
