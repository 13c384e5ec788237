"""models/protocol.py: what a model declares (``Capabilities``) and the check that names what a model
object lacks of the ``Model`` protocol."""

import dataclasses
from types import SimpleNamespace

import pytest

from verispec.errors import CheckpointError
from verispec.models.protocol import Capabilities, check_model


def test_capabilities_are_off_unless_declared_and_frozen():
    declared = Capabilities(trees=True)
    assert declared.trees and not any(getattr(declared, field.name) for field in dataclasses.fields(Capabilities)
                                      if field.name != "trees")
    with pytest.raises(dataclasses.FrozenInstanceError):
        declared.batching = True


def test_check_model_names_what_is_missing():
    complete = SimpleNamespace(config=None, capabilities=Capabilities(), new_cache=None, forward=None)
    check_model(complete)
    with pytest.raises(CheckpointError, match="^SimpleNamespace does not implement the Model protocol: missing "
                                              "capabilities, new_cache, forward$"):
        check_model(SimpleNamespace(config=None))
    wrong = SimpleNamespace(config=None, capabilities={"trees": True}, new_cache=None, forward=None)
    with pytest.raises(CheckpointError, match=r"^SimpleNamespace.capabilities must be a "
                                              r"verispec.models.protocol.Capabilities$"):
        check_model(wrong)
