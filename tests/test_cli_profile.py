"""cli_profile.py: ``verispec profile`` refuses, before measuring anything, output paths it could not
write and a context past the target's."""

from __future__ import annotations

import os

import pytest

from verispec.cli import main
from verispec.cli_profile import _check_writable
from verispec.errors import VerispecError


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class LongWork(Exception):
    """Raised by stand-ins for loading and measuring: reaching one means the arguments were accepted."""


def run_to_exit(capsys, *argv):
    """``run``, with argparse's own exits (bad option syntax, --help) as their exit status."""
    try:
        return run(capsys, *argv)
    except SystemExit as exit_info:
        out, err = capsys.readouterr()
        return exit_info.code, out, err


def one_line_error(code, err, message):
    return code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_profile_refuses_an_out_path_that_is_a_folder_and_a_context_past_the_model_before_measuring(
        capsys, monkeypatch, tmp_path):
    import verispec.profile

    def refuse(*args, **kwargs):
        raise LongWork

    monkeypatch.setattr(verispec.profile, "profile", refuse)
    code, _, err = run_to_exit(capsys, "profile", "--target", "tiny", "--out", str(tmp_path))
    assert one_line_error(code, err, "is a folder")
    code, _, err = run_to_exit(capsys, "profile", "--target", "tiny", "--plot", str(tmp_path / "no" / "v.png"),
                       "--out", str(tmp_path / "p.json"))
    assert one_line_error(code, err, "--plot")
    code, _, err = run_to_exit(capsys, "profile", "--target", "tiny", "--context", "100000",
                               "--out", str(tmp_path / "p.json"))
    assert one_line_error(code, err, "exceed the target's context")


def test_check_writable_names_the_option_and_what_is_wrong(tmp_path):
    _check_writable("--out", str(tmp_path / "p.json"))  # a new file in an existing folder
    (tmp_path / "p.json").write_text("{}")
    _check_writable("--out", str(tmp_path / "p.json"))  # an existing file is overwritten
    with pytest.raises(VerispecError, match=r"^--out '.*' is a folder; give a file path$"):
        _check_writable("--out", str(tmp_path))
    with pytest.raises(VerispecError, match=r"^--out '' is a folder; give a file path$"):
        _check_writable("--out", "")
    with pytest.raises(VerispecError, match=r"^--plot .*v.png: the folder '.*no' does not exist$"):
        _check_writable("--plot", str(tmp_path / "no" / "v.png"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_check_writable_refuses_a_read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(VerispecError, match="not writable"):
            _check_writable("--out", str(folder / "p.json"))
    finally:
        folder.chmod(0o700)
