"""errors.py: every user error is a ``VerispecError`` (the CLI's exit 2, the server's HTTP 400), and the
library raises the specific kind for checkpoints, sampling parameters and context overflows."""

from __future__ import annotations

import pytest

from verispec.errors import CheckpointError, ContextError, SamplingError, VerispecError


@pytest.mark.parametrize("kind", [CheckpointError, SamplingError, ContextError])
def test_each_kind_is_a_user_error_that_keeps_its_message(kind):
    assert issubclass(kind, VerispecError) and not issubclass(VerispecError, kind)
    with pytest.raises(VerispecError) as caught:
        raise kind("what was wrong; what to do")
    assert type(caught.value) is kind and str(caught.value) == "what was wrong; what to do"


def test_the_library_raises_the_specific_kind(tmp_path):
    from verispec.checkpoints import checkpoint_dir
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.engine import SpecEngine
    from verispec.models.llama import LlamaConfig, LlamaForCausalLM

    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_dir(tmp_path / "nowhere")
    with pytest.raises(SamplingError, match="top_p must be in"):
        SamplingParams(top_p=0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, max_position_embeddings=8))
    with pytest.raises(ContextError, match=r"prompt \(4 tokens\) \+ max_tokens \(5\) exceeds the model's context "
                                           "of 8 tokens"):
        SpecEngine(target).generate([1, 2, 3, 4], SamplingParams(), SpecConfig(method="none"), StopRules(max_tokens=5))


def test_the_cli_prints_a_user_error_as_one_line_and_exits_2(capsys):
    from verispec.cli import main

    assert main(["plan", "--alpha", "0.5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("verispec: error: give --alpha or --acceptance and")
    assert captured.err.count("\n") == 1
