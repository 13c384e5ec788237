"""options.py: the shared command-line options and the configs they become (spec_from_args,
sampling_from_args), and the one-line error convention."""

from __future__ import annotations

import pytest

from verispec.config import SamplingParams, SpecConfig
from verispec.errors import VerispecError


def test_one_spelling_for_the_adaptive_policy_in_generate_and_serve():
    """generate takes serve's --adaptive and serve takes generate's --gamma-policy adaptive; both run chains
    adaptively unless told --gamma-policy fixed, and trees with their fixed shape."""
    from verispec.cli import build_parser
    from verispec.options import spec_from_args
    from verispec.server.cli import config_from_args

    parser = build_parser()
    assert spec_from_args(parser.parse_args(["generate", "x", "--adaptive"])).gamma_policy == "adaptive"
    assert spec_from_args(parser.parse_args(["generate", "x"])).gamma_policy == "adaptive"
    assert spec_from_args(parser.parse_args(["generate", "x", "--gamma-policy", "fixed"])).gamma_policy == "fixed"
    assert spec_from_args(parser.parse_args(["generate", "x", "--tree", "s3_k2_d6"])).gamma_policy == "fixed"
    assert spec_from_args(parser.parse_args(["audit", "--gamma", "3"])).gamma_policy == "fixed"  # audits: --gamma
    served = parser.parse_args(["serve"])
    assert config_from_args(served)[0].gamma_policy == "adaptive" and served.adaptive
    tree = parser.parse_args(["serve", "--tree", "s3_k2_d6"])
    assert config_from_args(tree)[0].gamma_policy == "fixed" and not tree.adaptive
    served = parser.parse_args(["serve", "--gamma-policy", "adaptive"])
    config_from_args(served)
    assert served.adaptive
    plain = parser.parse_args(["serve", "--gamma-policy", "fixed"])
    config_from_args(plain)
    assert not plain.adaptive


def parse(*argv):
    from verispec.cli import build_parser

    return build_parser().parse_args(["generate", "x", *argv])


@pytest.mark.parametrize("argv, spec", [
    ((), SpecConfig(gamma_policy="adaptive")),  # chains: adaptive unless told --gamma-policy fixed
    (("--no-spec", "--method", "tree"), SpecConfig(method="none")),
    (("--method", "tree", "--gamma", "3"), SpecConfig(method="tree", gamma=3)),
    (("--tree", "s2_k2_d4"), SpecConfig(method="tree", tree="s2_k2_d4")),  # a shape makes the draft model's a tree
    (("--method", "ngram", "--ngram-max", "3", "--ngram-min", "2"),
     SpecConfig(drafter="ngram", ngram_max=3, ngram_min=2, gamma_policy="adaptive")),
    (("--method", "ngram", "--tree", "s3_k2_d6"), SpecConfig(method="tree", tree="s3_k2_d6", drafter="ngram")),
    (("--method", "self", "--exit-layer", "2", "--tree", "s3_k2_d6"),
     SpecConfig(drafter="early_exit", exit_layer=2, gamma_policy="adaptive")),  # self-speculation drafts chains only: the tree is ignored
    (("--method", "eagle", "--gamma-policy", "hf"), SpecConfig(drafter="eagle", gamma_policy="hf")),
    (("--method", "tree", "--sibling-mode", "iid"), SpecConfig(method="tree", sibling_mode="iid")),
])
def test_spec_from_args_maps_each_method_to_its_config(argv, spec):
    from verispec.options import spec_from_args

    assert spec_from_args(parse(*argv)) == spec


def test_sampling_from_args_and_its_defaults():
    from verispec.options import sampling_from_args

    assert sampling_from_args(parse()) == SamplingParams(temperature=0.0)  # generate is greedy by default
    args = parse("--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05", "--presence-penalty",
                 "0.5", "--frequency-penalty", "-0.5", "--repetition-penalty", "1.2")
    assert sampling_from_args(args) == SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                                                      presence_penalty=0.5, frequency_penalty=-0.5,
                                                      repetition_penalty=1.2)


def test_eagle_args_ask_for_a_head_only_when_the_spec_drafts_with_one():
    from verispec.options import eagle_args

    args = parse("--eagle", "/heads/h")
    assert eagle_args(args, SpecConfig(drafter="eagle")) == {"need_eagle": True, "eagle_dir": "/heads/h"}
    assert eagle_args(args, SpecConfig()) == {"need_eagle": False, "eagle_dir": "/heads/h"}
    assert eagle_args(args, SpecConfig(method="none")) == {"need_eagle": False, "eagle_dir": "/heads/h"}


def test_read_text_file_and_threads_errors_say_which_option(tmp_path):
    from verispec.options import apply_threads, read_text_file

    (tmp_path / "p.txt").write_text("predicted")
    assert read_text_file("--prediction", str(tmp_path / "p.txt")) == "predicted"
    with pytest.raises(VerispecError, match=r"^cannot read --prediction '.*missing.txt': No such file or directory$"):
        read_text_file("--prediction", str(tmp_path / "missing.txt"))
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xff")
    with pytest.raises(VerispecError, match=r"^cannot read --grammar '.*bad.txt': 'utf-8' codec can't decode"):
        read_text_file("--grammar", str(tmp_path / "bad.txt"))
    with pytest.raises(VerispecError, match=r"^--threads must be >= 0, got -2$"):
        apply_threads(parse("--threads", "-2"))


def test_a_bad_option_is_one_line_and_exit_2(capsys):
    from verispec.options import OneLineArgumentParser

    parser = OneLineArgumentParser(prog="verispec x")
    parser.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--n", "many"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("verispec x: error: argument --n: invalid int value: 'many' "
                                       "(see 'verispec x --help')\n")
