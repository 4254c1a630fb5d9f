"""``torchspmd <command> --help`` works for every command, in a fresh process, and says
what each setting does."""

import subprocess
import sys

import pytest
from _helpers import clean_env

from torchspmd.cli import COMMANDS

pytestmark = pytest.mark.smoke


def _help(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchspmd.cli", *args], capture_output=True, text=True,
                          timeout=120, env=clean_env())


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_working_help(command, flag):
    r = _help(command, flag)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"usage: torchspmd {command}"), r.stdout[:300]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_the_top_level_help_names_every_command():
    r = _help("--help")
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
