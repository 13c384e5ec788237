"""TOML values checked against the settings they fill (``verispec.bench.config``): the kind a field's
annotation names (``check_type``), "inf" as a number, the tables of a ``[[serving.launch]]`` (``arguments``,
``environment``) and the ``verispec serve`` arguments a launch passes (``check_serve_arguments``)."""

from __future__ import annotations

import dataclasses
import math

from verispec.errors import VerispecError


def check_serve_arguments(args: tuple[str, ...], where: str) -> None:
    """The arguments a launched ``verispec serve`` gets, parsed and checked as that command will, so
    that a typo fails now and not after the offline part of the run (the TOML file's launches, and
    --serve's)."""
    import contextlib
    import io

    from verispec.options import OneLineArgumentParser
    from verispec.server.cli import add_parser, config_from_args

    parser = OneLineArgumentParser(prog="verispec")
    add_parser(parser.add_subparsers())
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parsed = parser.parse_args(["serve", *args])
    except SystemExit:
        reason = (errors.getvalue().strip().splitlines() or ["cannot be parsed"])[-1]
        reason = reason.partition(" error: ")[2] or reason
        raise VerispecError(f"bench config: {where} args: {reason.split(' (see ')[0]}") from None
    try:
        config_from_args(parsed)
    except VerispecError as err:
        raise VerispecError(f"bench config: {where} args: {err}") from None


def check_type(field: dataclasses.Field, value, path: str) -> None:
    """A value of the kind the field's annotation names (an int where an int is expected, a list of
    strings where ``tuple[str, ...]`` is); kinds not listed here are left to the constructor."""
    ok, kind = _fits(str(field.type), value)
    if not ok:
        raise VerispecError(f"bench config: {path} must be {kind}, got {value!r}")


_KINDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string", "None": "unset"}


def _fits(annotation: str, value) -> tuple[bool, str]:
    """(whether ``value`` fits ``annotation``, the kind in words); unknown annotations fit anything."""
    options = [a.strip() for a in annotation.split("|")] if not annotation.startswith("tuple[") else [annotation]
    kinds = []
    for option in options:
        if option.startswith("tuple[") and option.endswith(", ...]"):
            item_ok = [_fits(option[len("tuple["):-len(", ...]")], v) for v in value] \
                if isinstance(value, (list, tuple)) else [(False, "")]
            item_kind = _fits(option[len("tuple["):-len(", ...]")], None)[1]
            kinds.append(f"a list of {item_kind.removeprefix('an ').removeprefix('a ')}s"
                         if item_kind in _KINDS.values() else "a list")
            if all(ok for ok, _ in item_ok):
                return True, kinds[-1]
            continue
        if option not in _KINDS:
            return True, "anything"
        kinds.append(_KINDS[option])
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ((option == "bool" and isinstance(value, bool))
                or (option == "int" and number and isinstance(value, int))
                or (option == "float" and (number or (isinstance(value, str) and value.lower() in ("inf", "infinity"))))
                or (option == "str" and isinstance(value, str))
                or (option == "None" and value is None)):
            return True, kinds[-1]
    return False, " or ".join(k for k in kinds if k != "unset")


def arguments(value, path: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise VerispecError(f"bench config: {path}.args must be a list of strings (arguments of verispec serve), "
                            f"got {value!r}")
    return value


def environment(value, path: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise VerispecError(f"bench config: {path}.env must be a table of strings (NAME = \"value\")")
    return tuple(sorted(value.items()))


def listify(value, path: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise VerispecError(f"bench config: {path} must be a list of tables")
    return value


def number(value, field: dataclasses.Field | None = None):
    """"inf" as math.inf where the field takes numbers (request_rates = ["inf"]); anything else unchanged."""
    takes_numbers = field is None or "float" in str(field.type)
    if takes_numbers and isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return math.inf
    return value
