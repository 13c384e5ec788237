"""``verispec generate``: decode one prompt, with or without speculation, and print the text and its stats.

    verispec generate "Write a haiku" --chat --method tree
"""

from __future__ import annotations

import json

from verispec.options import (add_grammar_options, add_model_options, add_sampling_options, add_spec_options,
                              add_threads_option, eagle_args, grammar_from_args, guided, read_text_file,
                              sampling_from_args, spec_from_args)


def add_parser(commands) -> None:
    """Register ``verispec generate`` on the CLI's subparsers."""
    gen = commands.add_parser("generate", help="decode one prompt, with or without speculation",
                              description="Decode PROMPT with the target, verifying a draft model's proposals. "
                                          "With no --target, SmolLM2-135M-Instruct and its shipped draft.")
    gen.add_argument("prompt", metavar="PROMPT", help="prompt text (use --chat to apply the chat template)")
    add_model_options(gen)
    add_threads_option(gen)
    add_sampling_options(gen)
    add_spec_options(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="maximum new tokens (default 64)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable); the text is cut before it")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message with the chat template")
    add_grammar_options(gen)
    gen.add_argument("--prediction", metavar="FILE",
                     help="predicted output: text the answer is expected to repeat (e.g. the file being edited); "
                          "its tokens are the drafts instead of --method's (verified: the output is unchanged)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, stats")
    gen.add_argument("--verbose", action="store_true", help="log progress")
    gen.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    from verispec.config import StopRules
    import dataclasses

    from verispec.engine import SpecEngine
    from verispec.loading import build_single, check_model_args, encode_prompt, eos_ids, load_pair, resolve_draft_vocab

    sampling = sampling_from_args(args)
    spec = spec_from_args(args)
    grammar = grammar_from_args(args)
    prediction = read_text_file("--prediction", args.prediction) if args.prediction is not None else None
    if prediction is not None:  # the prediction drafts, whatever --method says
        from verispec.drafters.prediction import PREDICTION_DRAFTS

        spec = dataclasses.replace(spec, method="chain", drafter="ngram", gamma=PREDICTION_DRAFTS)
    needs_draft = spec.enabled and spec.drafter == "model"
    check_model_args(args.target, args.draft, needs_draft)
    pair = load_pair(args.target, args.draft, device=args.device, need_draft=needs_draft, backend=args.backend,
                     draft_weights=args.draft_weights, **eagle_args(args, spec))
    if needs_draft:
        spec = dataclasses.replace(spec, draft_vocab=resolve_draft_vocab(pair, args.draft_vocab))
    tokenizer = pair.tokenizer
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat)
    stop = StopRules(max_tokens=args.max_tokens, eos_ids=tuple(eos_ids(tokenizer, pair.target)),
                     ignore_eos=args.ignore_eos, stop_strings=tuple(args.stop))
    sampling = guided(sampling, grammar, pair, list(stop.eos_ids))
    engine = build_single(pair, spec)
    if prediction is not None:
        from verispec.drafters.prediction import PredictionDrafter

        engine = SpecEngine(pair.target, PredictionDrafter(tokenizer.encode(prediction, add_special_tokens=False)),
                            decode=engine.decode)
    result = engine.generate(prompt_ids, sampling, spec, stop, seed=args.seed)
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    if result.stop_text_index is not None:
        text = text[:result.stop_text_index]
    summary = result.stats.summary()
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": text, "stats": summary}))
        return 0
    print(text)
    print()
    print(format_stats(summary, spec.enabled))
    return 0


def format_stats(summary: dict, speculative: bool) -> str:
    split = summary["time_split"]
    rows = [
        ("generated tokens", f"{summary['generated_tokens']} ({summary['finish_reason']})"),
        ("tokens/s", f"{summary['tokens_per_s']:.1f}"),
        ("TTFT ms", f"{summary['ttft_ms']:.1f}"),
        ("rounds", str(summary["rounds"])),
    ]
    if speculative:
        conditional = summary["per_position_acceptance"]["conditional"]
        rows += [
            ("committed tokens/round", f"{summary['committed_per_round']:.2f}"),
            ("draft acceptance rate", f"{summary['acceptance_rate']:.3f} ({summary['accepted']}/{summary['drafted']})"),
            ("acceptance by position", " ".join(f"{a:.2f}" for a in conditional) + " (conditional)"),
            ("verified draft nodes/round", f"{summary['tree_nodes']:.2f}"),
        ]
    rows.append(("time split ms", " ".join(f"{k.removesuffix('_ms')}={v:.0f}" for k, v in split.items())))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
