"""Command-line flags: a misspelt one exits 64 naming the closest, none is abbreviated (issue 42, item 5), and the
parser is built on argparse's public API (issue 43)."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "kafkatx"


def _kafkatx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafkatx", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KAFKATX_BOOTSTRAP_SERVERS": ""},
    )


@pytest.mark.parametrize("flag", [["--instance-idd", "pod-1"], ["--instance-idd=pod-1"]])
def test_a_misspelt_flag_exits_64_with_the_closest_one(flag: list[str]) -> None:
    done = _kafkatx("run", "examples.orders:app", *flag)
    assert done.returncode == 64, done.stderr
    assert "kafkatx run: error: unrecognized arguments: --instance-idd" in done.stderr
    assert "did you mean --instance-id?" in done.stderr


@pytest.mark.parametrize(("flag", "meant"), [("--instance-i", "--instance-id"), ("--worker", "--workers")])
def test_an_abbreviated_flag_is_refused(flag: str, meant: str) -> None:
    done = _kafkatx("run", "examples.orders:app", flag, "2")
    assert done.returncode == 64, done.stderr
    assert f"options are never abbreviated: did you mean {meant}?" in done.stderr


def test_an_unknown_flag_far_from_every_option_gets_no_guess() -> None:
    done = _kafkatx("run", "examples.orders:app", "--bogus")
    assert done.returncode == 64, done.stderr
    assert done.stderr.rstrip().endswith("unrecognized arguments: --bogus")


def test_the_other_commands_name_the_closest_flag_too_and_keep_their_exit_code() -> None:
    done = _kafkatx("dlq", "inspect", "orders-dlt", "--filtr", "partition=0")
    assert done.returncode == 2, done.stderr  # docs/DLQ.md: 2 for bad arguments
    assert "did you mean --filter?" in done.stderr


def test_verbosity_flags_still_count_before_and_after_the_command() -> None:
    from kafkatx.cli import _build_parser

    args = _build_parser().parse_args(["-v", "run", "examples.orders:app", "-vv"])
    assert (args.verbose, args.sub_verbose) == (1, 2)


def test_the_command_line_uses_no_private_member_of_argparse() -> None:
    private = {name for name in [*dir(argparse), *dir(argparse.ArgumentParser())] if name.startswith("_")}
    private -= {name for name in private if name.startswith("__")}
    for path in [*sorted((SRC / "cli").glob("*.py")), SRC / "dlq" / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                assert node.attr not in private, f"{path.name}:{node.lineno} uses argparse's private .{node.attr}"
