"""Instruction counts of measured regions of a bench script, under callgrind (shared by the micro benchmarks).

The script re-runs itself as ``<script> --inner-callgrind ...`` under
``valgrind --tool=callgrind``, collection off; :func:`run_regions` (inside)
prints the plan of regions, then runs each inside ``sorted()``, whose
``builtin_sorted`` switches collection on and dumps when it returns (the
measured code never calls it); :func:`measure` (outside) reads one total per
dump. Instruction counts do not move with the machine's load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def measure(script: str, inner_args: Sequence[str], env: dict[str, str] | None = None) -> list[tuple[Any, int]]:
    """Run ``script --inner-callgrind inner_args`` under callgrind: each region's plan entry and its instructions."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    tmp = Path(tempfile.mkdtemp(prefix="kafkatx-callgrind-"))
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=builtin_sorted",
        "--dump-after=builtin_sorted",
        f"--callgrind-out-file={tmp}/cg.%p",
        sys.executable,
        script,
        "--inner-callgrind",
        *inner_args,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env if env is not None else dict(os.environ))
        plan_line = [line for line in proc.stdout.splitlines() if line.startswith("PLAN ")]
        if proc.returncode != 0 or not plan_line:
            raise SystemExit(f"callgrind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        plan = json.loads(plan_line[0][5:])
        dumps = sorted(tmp.glob("cg.*.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        totals = []
        for path in dumps:
            m = re.search(r"^(?:summary|totals): (\d+)", path.read_text(errors="replace"), re.M)
            totals.append(int(m.group(1)) if m else 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return list(zip(plan, totals[-len(plan) :]))


def run_regions(regions: Sequence[tuple[Any, Callable[[], None]]]) -> None:
    """Inside callgrind: print the plan (each region's JSON entry), then run each region once, measured."""
    sys.stdout.write("PLAN " + json.dumps([entry for entry, _ in regions]) + "\n")
    sys.stdout.flush()
    for _, region in regions:
        sorted((0,), key=lambda _: region())
