"""``torchspmd <command> --help`` works for every command and says what each setting does.
Each command's help is checked by calling the command line's ``main`` in this process; the
top-level help runs the installed ``torchspmd`` command in a fresh process."""

import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import clean_env

from torchspmd.cli import COMMANDS, main

pytestmark = pytest.mark.smoke


def _help_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``torchspmd *args`` as ``main`` runs it here: its exit status, stdout and stderr."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's --help exits
        code = e.code
    out, err = capsys.readouterr()
    return (0 if code is None else code if isinstance(code, int) else 1), out, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_working_help(capsys, command, flag):
    returncode, stdout, stderr = _help_in_process(capsys, command, flag)
    assert returncode == 0, stderr[-3000:]
    assert stdout.startswith(f"usage: torchspmd {command}"), stdout[:300]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_the_top_level_help_names_every_command():
    # The console script pip installs (pyproject's [project.scripts]); the environments that run the
    # clone from PYTHONPATH without installing it (torch-2.15's, newest's: .ci/envs.py) have none: its module.
    script = Path(sys.executable).with_name("torchspmd")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "torchspmd.cli"]
    r = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    for command in COMMANDS:
        assert command in r.stdout


def test_every_train_setting_says_what_it_does():
    """Each option of train (and explain, which takes train's) has a help text of its own,
    with its default, and a ``%`` in a text or a default cannot break the formatting."""
    from torchspmd.train.config import build_parser

    parser = build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 40
    missing = [a.option_strings[0] for a in options if not (a.help or "").strip()]
    assert not missing, missing
    text = parser.format_help()
    assert "at most 25%" in text  # the text that once broke argparse's formatting
