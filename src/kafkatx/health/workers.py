"""One health endpoint for ``kafkatx run --workers N``: the supervisor's, reporting every worker.

Each worker serves its own probes on a free port of 127.0.0.1 and writes
that port to the file the supervisor names in ``$KAFKATX_HEALTH_PORT_FILE``;
the supervisor serves the one port the orchestrator probes and asks each
worker when it is asked itself. The supervisor is live while every worker
process runs (and says it is live) or waits out its restart back-off; it is
ready when every worker says it is ready.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kafkatx.health.checks import Verdict

__all__ = [
    "ENV_HEALTH_PORT_FILE",
    "Probe",
    "WorkerState",
    "probe_worker",
    "read_port_file",
    "report_health_port",
    "workers_liveness",
    "workers_readiness",
]

#: Set by the supervisor for each worker: the file the worker writes its health port to.
ENV_HEALTH_PORT_FILE = "KAFKATX_HEALTH_PORT_FILE"

#: ``probe(port, path)``: the worker's HTTP status and JSON body, or ``(None, None)`` if it did not answer.
Probe = Callable[[int, str], tuple[int | None, Any]]


def report_health_port(port: int) -> None:
    """Under a supervisor, tell it the port this worker serves its probes on (atomically: it may read meanwhile)."""
    path = os.environ.get(ENV_HEALTH_PORT_FILE)
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(port))
    os.replace(tmp, path)


def read_port_file(path: str) -> int | None:
    """The port a worker reported, or None if it has not (yet)."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def probe_worker(port: int, path: str, timeout: float = 2.0) -> tuple[int | None, Any]:
    """GET ``http://127.0.0.1:port/path``: its status and JSON body; ``(None, None)`` if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, None
    except (OSError, ValueError):
        return None, None


@dataclass(frozen=True)
class WorkerState:
    instance_id: str
    #: "running", "restarting" (exited, waiting out its back-off) or "stopped" (for good).
    process: Literal["running", "restarting", "stopped"]
    #: The port the worker serves its probes on, once it said so.
    port: int | None = None
    #: Its process id while it runs.
    pid: int | None = None


def _row(w: WorkerState) -> dict[str, Any]:
    row: dict[str, Any] = {"worker": w.instance_id, "process": w.process}
    if w.pid is not None:
        row["pid"] = w.pid
    return row


def workers_liveness(workers: Sequence[WorkerState], probe: Probe = probe_worker) -> Verdict:
    """Live while every worker runs or is being restarted, and none that answers says it is not live."""
    rows = []
    for w in workers:
        row = _row(w)
        live = w.process != "stopped"
        if w.process == "running" and w.port is not None:
            status, body = probe(w.port, "/livez")
            row["health"] = body
            live = status != 503  # not answering yet (starting, busy) is not a reason to restart everything
        row["live"] = live
        rows.append(row)
    ok = all(row["live"] for row in rows)
    return Verdict(ok, {"status": "live" if ok else "not live", "workers": rows})


def workers_readiness(workers: Sequence[WorkerState], probe: Probe = probe_worker) -> Verdict:
    """Ready when every worker runs and says it is ready."""
    rows = []
    for w in workers:
        row = _row(w)
        if w.process != "running":
            ready, row["reason"] = False, f"process {w.process}"
        elif w.port is None:
            ready, row["reason"] = False, "starting (no health port reported yet)"
        else:
            status, body = probe(w.port, "/readyz")
            row["health"] = body
            ready = status == 200
            if status is None:
                row["reason"] = "does not answer its readiness probe"
        row["ready"] = ready
        rows.append(row)
    ok = bool(rows) and all(row["ready"] for row in rows)
    return Verdict(ok, {"status": "ready" if ok else "not ready", "workers": rows})
