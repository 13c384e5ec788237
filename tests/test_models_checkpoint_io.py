"""models/checkpoint_io.py: reading and writing checkpoint directories, and loading a state dict with a
CheckpointError that says what does not fit. The loaders' own refusals: test_llama.py, test_loading.py."""

import json

import pytest
import torch
from torch import nn

from verispec.errors import CheckpointError
from verispec.models.checkpoint_io import (load_all_weights, load_state, read_config_json, read_weights,
                                           weights_to_load, write_checkpoint)


def test_read_config_json_says_what_is_wrong(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; pass a directory holding config.json"):
        read_config_json(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"has no config.json; is it an HF checkpoint directory\?"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(.*\); re-export the checkpoint"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json is not a JSON object; re-export the checkpoint"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_config_json(tmp_path) == {"model_type": "llama"}


def test_write_then_read_round_trips_and_leaves_out_a_tied_head(tmp_path):
    model = nn.Module()
    model.embed = nn.Linear(4, 6, bias=False)
    model.lm_head = nn.Linear(4, 6, bias=False)
    write_checkpoint(model, {"model_type": "toy"}, tmp_path / "out", torch.bfloat16, tied=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "toy",
                                                                          "torch_dtype": "bfloat16"}
    state = read_weights(sorted((tmp_path / "out").glob("*.safetensors")))
    assert list(state) == ["embed.weight"] and state["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(state["embed.weight"], model.embed.weight.detach().to(torch.bfloat16))
    write_checkpoint(model, {}, tmp_path / "untied", torch.float32, tied=False)
    assert sorted(read_weights([tmp_path / "untied" / "model.safetensors"])) == ["embed.weight", "lm_head.weight"]


def test_a_corrupt_weights_file_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"cannot read {tmp_path / 'model.safetensors'}: "):
        read_weights([tmp_path / "model.safetensors"])


def test_weights_that_do_not_fit_name_the_first_tensor(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    one_wrong = {**model.state_dict(), "0.weight": torch.zeros(5, 4)}
    with pytest.raises(CheckpointError, match=f"^weights in '{tmp_path}' do not fit its config.json: size "
                                              "mismatch for 0.weight: .*torch.Size\\(\\[5, 4\\]\\).*[^.]$"):
        load_state(model, one_wrong, tmp_path)
    two_wrong = {**one_wrong, "1.bias": torch.zeros(7)}
    with pytest.raises(CheckpointError, match=r"size mismatch for 0.weight: .* \(and 1 more\)$"):
        load_state(model, two_wrong, tmp_path)


def test_every_parameter_must_be_loaded_and_every_tensor_used(tmp_path):
    model = nn.Linear(4, 3)
    weight_only = {"weight": torch.ones(3, 4)}
    with pytest.raises(CheckpointError, match=r"do not match its config.json: missing \['bias'\], unexpected \[\]"):
        load_all_weights(model, weight_only, tmp_path)
    load_all_weights(model, weight_only, tmp_path, may_lack={"bias"})
    assert torch.equal(model.weight, torch.ones(3, 4))
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['extra'\]"):
        load_all_weights(model, {**model.state_dict(), "extra": torch.zeros(1)}, tmp_path)


def test_weights_to_load_skips_random_initialisation_and_restores_it():
    originals = (nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.normal_)
    torch.manual_seed(0)
    with weights_to_load():
        nn.Linear(4, 4)
        state_inside = torch.get_rng_state()
    torch.manual_seed(0)
    assert torch.equal(state_inside, torch.get_rng_state())  # nothing was drawn: the init functions were skipped
    with pytest.raises(RuntimeError, match="inside"):
        with weights_to_load():
            raise RuntimeError("inside")
    assert (nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.normal_) == originals  # restored, even on errors
    torch.manual_seed(0)
    nn.Linear(4, 4)
    assert not torch.equal(state_inside, torch.get_rng_state())  # outside, the layer draws its weights again
