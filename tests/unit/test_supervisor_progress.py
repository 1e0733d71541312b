"""The supervisor's crash-loop limit counts only crashes after which the worker had got nowhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kafkatx.cli import supervisor as supervisor_module
from kafkatx.cli.supervisor import Supervisor

# A worker that crashes (exit 3) on each of its first `runs` starts, then finishes (exit 0);
# with PROGRESS set it touches its progress file before crashing, as a worker that committed something does.
WORKER = """
import os, sys
runs_file, runs, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
with open(runs_file, "a") as f:
    f.write("x")
if len(open(runs_file).read()) > runs:
    sys.exit(0)
if progress:
    os.utime(os.environ["KAFKATX_PROGRESS_FILE"])
sys.exit(3)
"""


def run_worker(tmp_path: Path, crashes: int, progress: bool) -> tuple[int, int]:
    runs = tmp_path / "runs"
    code = Supervisor([sys.executable, "-c", WORKER, str(runs), str(crashes), "1" if progress else "0"], ["w"]).run()
    return code, len(runs.read_text())


@pytest.fixture(autouse=True)
def fast_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "_FIRST_BACKOFF_S", 0.01)


def test_crashes_after_progress_are_restarted_past_the_crash_loop_limit(tmp_path: Path) -> None:
    code, starts = run_worker(tmp_path, crashes=supervisor_module._MAX_CRASHES + 1, progress=True)
    assert code == 0 and starts == supervisor_module._MAX_CRASHES + 2, "restarted until it finished"


def test_crashes_without_progress_end_the_run(tmp_path: Path) -> None:
    code, starts = run_worker(tmp_path, crashes=supervisor_module._MAX_CRASHES + 1, progress=False)
    assert code == 1 and starts == supervisor_module._MAX_CRASHES, "a crash loop: given up"
