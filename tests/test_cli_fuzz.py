"""Random argument lists for every subcommand: each ends in exit 0 or exit 2 with one line on stderr, never a
traceback. Loading, measuring, benchmarking and training are replaced by stand-ins that raise ``Accepted``:
reaching one means the arguments passed every check made before long work (nothing loads or runs)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.cli import build_parser, main

COMMANDS = ("generate", "plan", "profile", "audit", "bench", "serve", "train", "demo")
JUNK = ("-1", "0", "1", "2", "8", "-5", "0.5", "1e9", "100000000", "99999999999999999999", "nan", "inf", "-inf",
        "", " ", "abc", "1,2", "0.5,x", "tiny", "chain", "/nonexistent-verispec/x.json", "\udcff")


class Accepted(Exception):
    """A stand-in for long work was reached."""


@pytest.fixture
def stand_ins(monkeypatch):
    import verispec.bench.run
    import verispec.demo
    import verispec.loading
    import verispec.profile
    import verispec.train.train

    def accept(*args, **kwargs):
        raise Accepted

    for module, name in ((verispec.loading, "load_pair"), (verispec.loading, "load_target_and_tokenizer"),
                         (verispec.profile, "profile"), (verispec.bench.run, "run_bench"),
                         (verispec.demo, "_load_demo_pair"), (verispec.train.train, "_run")):
        monkeypatch.setattr(module, name, accept)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # --threads 100000000 must not reach torch


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    return [(flag, action) for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


PARSERS = _subparsers(build_parser())
TRAIN_PARSERS = _subparsers(__import__("verispec.train.train", fromlist=["_parser"])._parser())


def _value(action: argparse.Action) -> st.SearchStrategy[str]:
    choices = [str(c) for c in action.choices or ()]
    return st.sampled_from(choices + list(JUNK)) if choices else st.sampled_from(JUNK)


@st.composite
def argument_lists(draw, command: str) -> list[str]:
    if command == "train":
        sub = draw(st.sampled_from(sorted(TRAIN_PARSERS) + ["", "--help", "bogus"]))
        parser = TRAIN_PARSERS.get(sub)
        argv = ["train"] + ([sub] if sub else [])
        if parser is None:
            return argv
    else:
        parser, argv = PARSERS[command], [command]
        if command == "generate" and draw(st.integers(0, 9)) > 0:  # PROMPT, mostly given
            argv.append(draw(st.sampled_from(JUNK + ("hello",))))
    options = _options(parser)
    for flag, action in draw(st.lists(st.sampled_from(options), max_size=5)):
        argv.append(flag)
        if action.nargs != 0 and (action.nargs != "?" or draw(st.booleans())):
            argv.append(draw(_value(action)))
    if draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(("--help", "--no-such-option", "stray"))))
    return argv


def _outcome(argv: list[str]) -> tuple[object, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse: --help (0) and bad option syntax (2)
            code = exit_info.code
        except Accepted:
            code = "accepted"
    return code, err.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_random_arguments_end_in_exit_0_or_a_one_line_error(stand_ins, command):
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(argument_lists(command))
    def check(argv):
        code, err = _outcome(argv)
        assert "Traceback" not in err, (argv, err)
        assert code in (0, 2, "accepted"), (argv, code, err)
        if code == 2:
            assert len(err.strip().splitlines()) == 1, (argv, err)

    check()
