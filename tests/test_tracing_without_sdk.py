"""``kafkatx run --tracing`` without an OpenTelemetry SDK exits 78 naming what to install (issue 42, item 6).

Without an SDK the global TracerProvider is the API's no-op one: the run would trace nothing and say nothing.
The SDK is hidden from the child processes by a ``sitecustomize`` that makes ``opentelemetry.sdk`` unimportable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HIDE_THE_SDK = "import sys\nsys.modules['opentelemetry.sdk'] = None  # import fails, find_spec answers None\n"


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one process", "workers"])
def test_tracing_without_an_sdk_exits_78_naming_the_extra(tmp_path: Path, workers: list[str]) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE_THE_SDK)
    done = subprocess.run(
        [sys.executable, "-m", "kafkatx", "run", "examples.orders:app", "--tracing", "--no-status", *workers]
        + ["--bootstrap-servers", "127.0.0.1:1"],  # never reached: the check comes first
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 78, done.stderr
    assert "kafkatx run: --tracing: no OpenTelemetry SDK is installed" in done.stderr
    assert "pip install 'kafkatx[otel]' opentelemetry-sdk" in done.stderr


def test_the_sdk_hider_hides_only_the_sdk(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE_THE_SDK)
    probe = "import importlib.util, opentelemetry.trace; print(importlib.util.find_spec('opentelemetry.sdk'))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.stdout.strip() == "None", done.stderr
