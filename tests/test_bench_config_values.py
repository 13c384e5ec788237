"""verispec.bench.config_values: each TOML value checked against the annotation of the field it fills, with
an error that names the key, the expected kind and the value given."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verispec.bench.config_values import (arguments, check_serve_arguments, check_type, environment, listify,
                                          number)
from verispec.errors import VerispecError


@dataclasses.dataclass
class _Fields:
    flag: bool = False
    count: int = 0
    rate: float = 1.0
    rates: tuple[float, ...] = ()
    names: tuple[str, ...] = ()
    maybe: bool | None = None
    vocab: str | int = "auto"


FIELDS = {f.name: f for f in dataclasses.fields(_Fields)}


@pytest.mark.parametrize("name, value", [
    ("flag", True), ("count", 3), ("rate", 2), ("rate", 0.5), ("rate", "inf"), ("rates", [1, "inf"]),
    ("names", ["a", "b"]), ("maybe", None), ("maybe", False), ("vocab", 512), ("vocab", "auto"),
])
def test_values_that_fit_their_field_pass(name, value):
    check_type(FIELDS[name], value, f"x.{name}")


@pytest.mark.parametrize("name, value, message", [
    ("flag", 1, "x.flag must be true or false, got 1"),
    ("count", True, "x.count must be an integer, got True"),  # a bool is not a count
    ("count", 2.5, "x.count must be an integer, got 2.5"),
    ("rate", "fast", "x.rate must be a number, got 'fast'"),
    ("rates", "1.0", "x.rates must be a list of numbers, got '1.0'"),
    ("names", ["a", 3], "x.names must be a list of strings, got ['a', 3]"),
    ("maybe", "yes", "x.maybe must be true or false, got 'yes'"),
    ("vocab", 1.5, "x.vocab must be a string or an integer, got 1.5"),
])
def test_values_of_the_wrong_kind_name_the_key_and_kind(name, value, message):
    with pytest.raises(VerispecError) as caught:
        check_type(FIELDS[name], value, f"x.{name}")
    assert str(caught.value) == f"bench config: {message}"


def test_inf_becomes_a_number_only_where_the_field_takes_numbers():
    assert number("inf", FIELDS["rates"]) == math.inf and number("Infinity") == math.inf
    assert number("inf", FIELDS["names"]) == "inf" and number(3, FIELDS["rate"]) == 3


def test_launch_tables_are_checked():
    assert arguments(["--method", "chain"], "serving.launch[0]") == ["--method", "chain"]
    with pytest.raises(VerispecError, match=r"serving.launch\[0\].args must be a list of strings"):
        arguments("--method chain", "serving.launch[0]")
    assert environment({"B": "2", "A": "1"}, "l") == (("A", "1"), ("B", "2"))  # sorted: stable in the result
    with pytest.raises(VerispecError, match=r"l.env must be a table of strings"):
        environment({"A": 1}, "l")
    assert listify([{"name": "a"}], "serving.endpoints") == [{"name": "a"}]
    with pytest.raises(VerispecError, match="serving.endpoints must be a list of tables"):
        listify({"name": "a"}, "serving.endpoints")


def test_serve_arguments_are_parsed_as_verispec_serve_would():
    check_serve_arguments(("--method", "chain"), "serving.launch[0] (ours)")
    with pytest.raises(VerispecError) as caught:
        check_serve_arguments(("--metod", "chain"), "serving.launch[0] (ours)")
    assert str(caught.value) == "bench config: serving.launch[0] (ours) args: unrecognized arguments: --metod chain"
    with pytest.raises(VerispecError, match=r"serving.launch\[1\] \(b\) args: argument --method: invalid choice"):
        check_serve_arguments(("--method", "bogus"), "serving.launch[1] (b)")
