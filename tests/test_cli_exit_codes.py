"""``kafkatx run`` exits with the codes the README's CLI section documents (issue 29, item 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kafkatx.app.signals import SAME_REQUEST_WINDOW_S
from kafkatx.testing import wait_for

ROOT = Path(__file__).resolve().parent.parent

# A worker that takes SIGINT and keeps running, as one finishing a long batch would: only a kill ends it.
STUBBORN_WORKER = (
    "import os, signal, time; signal.signal(signal.SIGINT, lambda *_: os.write(1, b'stopping\\n')); "
    "os.write(1, b'ready\\n'); time.sleep(120)"
)
SUPERVISOR = textwrap.dedent(
    """
    import sys
    from kafkatx.cli.supervisor import Supervisor

    sys.exit(Supervisor([sys.executable, "-c", sys.argv[1]], ["w-0", "w-1"], shutdown_timeout=60).run())
    """
)


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafkatx", "run", *args, "--no-status"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KAFKATX_BOOTSTRAP_SERVERS": ""},
    )


@pytest.mark.parametrize(
    ("target", "extra", "says"),
    [
        ("no_such_module_29:app", [], "cannot import module 'no_such_module_29'"),
        ("no_such_module_29:app", ["--workers", "2"], "cannot import module 'no_such_module_29'"),
        ("app.py", [], "is a file path"),
        ("justamodule", [], "expected module:attribute"),
        ("mod:app", ["--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_a_target_that_cannot_be_imported_or_a_bad_argument_exits_64(
    tmp_path: Path, target: str, extra: list[str], says: str
) -> None:
    done = _run(target, *extra, cwd=tmp_path)
    assert done.returncode == 64, done.stderr
    assert says in done.stderr


def _supervised(tmp_path: Path) -> subprocess.Popen[str]:
    (tmp_path / "sup.py").write_text(SUPERVISOR)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "sup.py"), STUBBORN_WORKER],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    assert [proc.stdout.readline(), proc.stdout.readline()] == ["ready\n", "ready\n"], "both workers started"
    return proc


def test_a_second_sigint_under_workers_kills_them_and_exits_130(tmp_path: Path) -> None:
    proc = _supervised(tmp_path)
    assert proc.stdout is not None
    proc.send_signal(signal.SIGINT)
    assert [proc.stdout.readline(), proc.stdout.readline()] == ["stopping\n", "stopping\n"], "forwarded to both"
    first = time.monotonic()  # a signal within the window repeats the first request (test_stop_signals)
    wait_for(lambda: time.monotonic() - first > SAME_REQUEST_WINDOW_S, message="the same-request window passed")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, "128 + SIGINT, as one process forced out by a second Ctrl-C"


def test_a_sigterm_under_workers_that_stops_them_exits_0(tmp_path: Path) -> None:
    proc = _supervised(tmp_path)
    proc.send_signal(signal.SIGTERM)  # the stubborn workers die of it: the stop the user asked for
    assert proc.wait(timeout=30) == 0


def test_the_readme_documents_every_exit_code() -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("Exit codes") :]
    for code, meaning in [("0", "stopped"), ("1", ""), ("64", "import"), ("78", "configuration"), ("130", "SIGINT")]:
        assert f"`{code}`" in section[:1500], f"exit code {code} is documented"
        assert meaning in section[:1500]
