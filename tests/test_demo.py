"""demo.py: ``verispec demo`` on the embedded pair (speculation is lossless for every method), without
it (the EAGLE methods are left out), and the --methods list it accepts."""

from __future__ import annotations

import json

import pytest

from verispec.cli import main
from verispec.config import SpecConfig
from verispec.demo import EAGLE_DEMO_TREE, method_specs
from verispec.errors import VerispecError


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_runs_the_embedded_pair_and_speculation_is_lossless(capsys):
    """The README's main job, shortened: every prompt's speculative output equals plain decoding."""
    code, out, _ = run(capsys, "demo", "--target", "tiny", "--prompts", "1", "--max-tokens", "8", "--threads", "1", "--json",
                       "--methods", "chain,tree,ngram,self")
    assert code == 0
    data = json.loads(out)
    assert data["embedded_pair"] and len(data["prompts"]) == 3 * 4
    assert {row["method"] for row in data["prompts"]} == {"chain", "tree", "ngram", "self"}
    assert all(row["identical"] for row in data["prompts"])
    code, out, _ = run(capsys, "demo", "--target", "tiny", "--prompts", "1", "--max-tokens", "8", "--threads", "1",
                       "--json", "--methods", "eagle,eagle-tree,eagle-lookup")
    rows = json.loads(out)["prompts"]
    assert code == 0 and {row["method"] for row in rows} == {"eagle", "eagle-tree", "eagle-lookup"}
    assert all(r["identical"] for r in rows)
    code, _, err = run(capsys, "demo", "--methods", "chain,beam")
    assert code == 2 and "beam" in err
    code, _, err = run(capsys, "demo", "--threads", "-1")
    assert code == 2 and "--threads" in err


def test_demo_without_the_embedded_pair_leaves_the_eagle_methods_out(capsys, monkeypatch):
    """The random stand-in pair has no EAGLE head: the default methods run without it, with a note;
    asking for EAGLE methods only is a one-line error."""
    import verispec.demo as demo

    monkeypatch.setattr(demo, "embedded_pair_available", lambda: False)
    code, out, err = run(capsys, "demo", "--target", "tiny", "--prompts", "1", "--max-tokens", "4", "--threads", "1",
                         "--json")
    assert code == 0 and "EAGLE methods are left out" in err
    assert {row["method"] for row in json.loads(out)["prompts"]} == {"chain", "tree", "ngram"}
    code, _, err = run(capsys, "demo", "--target", "tiny", "--methods", "eagle", "--threads", "1")
    assert code == 2 and "only EAGLE methods" in err


def test_method_specs_follow_the_order_given_once_each():
    specs = method_specs("tree, self,chain,tree", gamma=3, tree="s3_k2_d6", exit_layer=2)
    assert list(specs) == ["tree", "self", "chain"]
    assert specs["tree"] == SpecConfig(method="tree", tree="s3_k2_d6")
    assert specs["self"] == SpecConfig(gamma=3, drafter="early_exit", exit_layer=2)
    assert specs["chain"] == SpecConfig(gamma=3)
    eagle = method_specs("ngram,eagle,eagle-tree", gamma=5, tree="s3_k2_d6", exit_layer=1)
    assert eagle == {"ngram": SpecConfig(gamma=5, drafter="ngram"), "eagle": SpecConfig(gamma=5, drafter="eagle"),
                     "eagle-tree": SpecConfig(method="tree", tree=EAGLE_DEMO_TREE, drafter="eagle")}


@pytest.mark.parametrize("methods, message", [
    ("chain,beam", "--methods: unknown beam; choose from chain, tree, ngram, self, eagle, eagle-tree, eagle-lookup"),
    (" , ", "--methods: unknown (none given)"),
])
def test_method_specs_refuse_unknown_methods(methods, message):
    with pytest.raises(VerispecError) as caught:
        method_specs(methods, gamma=4, tree="s3_k2_d6", exit_layer=1)
    assert message in str(caught.value)
