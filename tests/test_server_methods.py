"""``serve`` runs every method the library does: trees (static and dynamic, every sibling mode), n-gram
chains and trees, self-speculation; concurrent greedy requests through the official client get the
target's own greedy text, and the command line spells methods and shapes as ``generate`` does."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from test_server import _greedy_args, greedy, pair, serving  # noqa: E402,F401 (fixture)
from verispec.config import SpecConfig  # noqa: E402
from verispec.engine import SpecEngine  # noqa: E402
from verispec.errors import VerispecError  # noqa: E402
from verispec.server.app import create_app  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402

PROMPTS = ["Hello", "The cat", "def f(x):", "1, 2, 3,", "abc abc abc"]


@pytest.mark.parametrize("spec", [SpecConfig(method="tree", tree="s3_k2_d6"),
                                  SpecConfig(method="tree", tree="dynamic:6"),
                                  SpecConfig(method="tree", tree="s2_k2_d4", drafter="ngram"),
                                  SpecConfig(gamma=2, drafter="early_exit", exit_layer=1),
                                  SpecConfig(gamma=3, lookup=2)],
                         ids=["tree", "dynamic", "ngram-tree", "self", "lookup"])
def test_every_method_is_served_losslessly(pair, spec):  # noqa: F811
    with serving(create_app(pair, spec, ServerConfig(max_batch=3, timeout_s=60))) as live:
        client = live.client()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more requests than rows: some wait for a free one
            texts = list(pool.map(lambda p: greedy(client, p, 14).choices[0].text, PROMPTS))
        drafted = live.metric("verispec:spec_decode_num_draft_tokens_total")
    assert drafted > 0
    for prompt, text in zip(PROMPTS, texts):
        alone = SpecEngine(pair.target).generate(
            list(pair.tokenizer.encode(prompt, add_special_tokens=False)), **_greedy_args(14))
        assert text == pair.tokenizer.decode(alone.tokens, skip_special_tokens=True), prompt


def serve_args(*argv: str) -> argparse.Namespace:
    from verispec.options import OneLineArgumentParser
    from verispec.server import cli

    parser = OneLineArgumentParser(prog="verispec")
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, expected", [
    (["--tree", "s3_k2_d6"], SpecConfig(method="tree", tree="s3_k2_d6")),
    (["--method", "tree", "--tree", "dynamic:8"], SpecConfig(method="tree", tree="dynamic:8")),
    (["--method", "self", "--exit-layer", "3", "--gamma", "5"],
     SpecConfig(gamma=5, drafter="early_exit", exit_layer=3, gamma_policy="adaptive")),  # chains: adaptive
    (["--method", "ngram", "--tree", "s2_k2_d4", "--ngram-max", "3"],
     SpecConfig(method="tree", tree="s2_k2_d4", drafter="ngram", ngram_max=3)),
    (["--method", "eagle", "--tree", "s3_k2_d6", "--sibling-mode", "iid"],
     SpecConfig(method="tree", tree="s3_k2_d6", drafter="eagle", sibling_mode="iid")),
    (["--method", "chain", "--gamma", "6"], SpecConfig(gamma=6, gamma_policy="adaptive")),
    (["--method", "chain", "--gamma-policy", "fixed"], SpecConfig()),
    (["--method", "eagle", "--lookup", "3", "--gamma", "2"],
     SpecConfig(gamma=2, drafter="eagle", lookup=3, gamma_policy="adaptive")),
    (["--no-spec"], SpecConfig(method="none")),
])
def test_serve_spells_methods_and_shapes_as_generate(argv, expected):
    from verispec.server.cli import config_from_args

    spec, _ = config_from_args(serve_args(*argv))
    assert spec == expected


def test_serve_refuses_adaptive_trees():
    from verispec.server.cli import config_from_args

    with pytest.raises(VerispecError, match="drop --adaptive or --tree"):
        config_from_args(serve_args("--tree", "s3_k2_d6", "--adaptive"))


class RepeatLast:
    """A drafter written only against the ``Drafter`` protocol (no base class): it proposes the last
    committed token again, as point masses."""

    shares_target_cache = wants_features = False
    max_context = None

    def propose(self, context, num_drafts, sampling, generator):
        import torch

        from verispec.drafters.base import Proposal

        return Proposal(torch.tensor([context[-1]] * num_drafts, dtype=torch.long), None)

    def propose_tree(self, context, shape, mode, sampling, generator):
        raise VerispecError("chains only")

    def commit(self, context):
        pass

    def reset(self):
        pass

    def bind(self, cache):
        pass

    def observe(self, features):
        pass

    def reads(self):
        from verispec.drafters.base import DraftReads

        return DraftReads()

    def unread(self, context):
        return 0  # no state of its own: nothing to read before drafting


def test_a_drafter_of_your_own_is_served(pair):  # noqa: F811
    """A new drafter needs no change to the server: ``create_app(make_drafter=...)`` lends one to each
    running request, and greedy output stays the target's."""
    spec = SpecConfig(gamma=3, drafter="ngram")  # the shape only: the drafter is ours
    with serving(create_app(pair, spec, ServerConfig(max_batch=2, timeout_s=60), make_drafter=RepeatLast)) as live:
        texts = [greedy(live.client(), prompt, 10).choices[0].text for prompt in PROMPTS[:3]]
        assert live.metric("verispec:spec_decode_num_draft_tokens_total") > 0
    for prompt, text in zip(PROMPTS, texts):
        alone = SpecEngine(pair.target).generate(
            list(pair.tokenizer.encode(prompt, add_special_tokens=False)), **_greedy_args(10))
        assert text == pair.tokenizer.decode(alone.tokens, skip_special_tokens=True), prompt
