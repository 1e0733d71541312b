"""``kafkatx run --workers N``: N worker processes under one supervisor.

Processes are how a Python service uses more than one core (the GIL). Each
worker is a plain ``kafkatx run`` of the same App with its own instance id,
``<id>-0`` ... ``<id>-(N-1)``, so its transactional.ids and its static group
membership are stable: a worker that crashes is restarted under the same id,
its predecessor's open transaction is aborted by the restart's
init_transactions, and its consumers take their partitions back without a
rebalance.

The supervisor forwards SIGINT/SIGTERM to every worker and waits for them
(exit 0 once they stopped gracefully); a second signal kills them, and the
run exits 128 + the first signal's number (130 for SIGINT, 143 for SIGTERM),
as one process forced out by a second signal does. Signals within
``SAME_REQUEST_WINDOW_S`` of the first are one request (kafkatx.app.signals):
systemd and GNU ``timeout`` signal the supervisor and its workers at once. A worker that exits non-zero is restarted after a
back-off (1 s, doubling to 30 s); one that keeps crashing (5 times within
60 s) ends the whole run with exit code 1, and a configuration error (exit
78) ends it at once with 78: restarting cannot fix either. A crash after
which the worker had made progress (:mod:`kafkatx.cli.progress`: records
committed, a record dead-lettered, the search for a record that kills the
process narrowed) is not a loop: it is restarted after 1 s and not counted.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kafkatx.app.signals import StopRequests
from kafkatx.cli.progress import ENV_PROGRESS_FILE, ProgressFile
from kafkatx.errors import InvalidConfigurationError
from kafkatx.health.server import HealthServer, verdict_response
from kafkatx.health.workers import (
    ENV_HEALTH_PORT_FILE,
    WorkerState,
    read_port_file,
    workers_liveness,
    workers_readiness,
)

__all__ = ["Supervisor", "WORKER_ENV", "worker_ids"]

log = logging.getLogger("kafkatx.supervisor")

EX_CONFIG = 78
#: The environment variable that tells a worker its instance id, for its log lines (kafkatx.logging.configure).
WORKER_ENV = "KAFKATX_WORKER_ID"
_CRASH_WINDOW_S = 60.0
_MAX_CRASHES = 5
_MAX_BACKOFF_S = 30.0
_FIRST_BACKOFF_S = 1.0


def worker_ids(base: str, workers: int) -> list[str]:
    return [f"{base}-{i}" for i in range(workers)]


@dataclass
class _Worker:
    instance_id: str
    progress: ProgressFile
    proc: subprocess.Popen[bytes] | None = None
    crashes: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float | None = None
    backoff: float = _FIRST_BACKOFF_S


class Supervisor:
    """Runs ``command + ["--instance-id", id]`` once per worker id, and keeps them running."""

    def __init__(
        self,
        command: Sequence[str],
        ids: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        shutdown_timeout: float = 60.0,
        health: tuple[str, int] | None = None,
        metrics: tuple[str, int] | None = None,
    ) -> None:
        self.command = list(command)
        self._progress_dir = tempfile.mkdtemp(prefix="kafkatx-progress-")
        self.workers = [
            _Worker(i, ProgressFile(os.path.join(self._progress_dir, i)), backoff=_FIRST_BACKOFF_S) for i in ids
        ]
        self.env = env
        self.shutdown_timeout = shutdown_timeout
        self._requests = StopRequests()
        #: True once :meth:`run` has its signal handlers installed and starts the workers.
        self.started = False
        self.exit_code = 0
        #: (address, port) of the one health endpoint that reports every worker (``--health-port``), if any.
        self.health = health
        self.health_server: HealthServer | None = None
        #: (address, port) of the one scrape endpoint of every worker's metrics (``--metrics-port``), if any.
        self.metrics = metrics
        self.metrics_server: HealthServer | None = None

    def _spawn(self, worker: _Worker) -> None:
        worker.progress.reset()
        env = {
            **(os.environ if self.env is None else self.env),
            ENV_PROGRESS_FILE: worker.progress.path,
            WORKER_ENV: worker.instance_id,
        }
        if self.health is not None or self.metrics is not None:
            port_file = self._health_port_file(worker)
            if os.path.exists(port_file):
                os.remove(port_file)  # the new process reports its own
            env[ENV_HEALTH_PORT_FILE] = port_file
        worker.proc = subprocess.Popen([*self.command, "--instance-id", worker.instance_id], env=env)
        worker.restart_at = None
        log.info("worker %s started (pid %d)", worker.instance_id, worker.proc.pid)

    def _on_signal(self, signum: int, _frame: object) -> None:
        request = self._requests.receive(signum)
        if request is None:  # the same request again (sent to the supervisor and its group): forwarded already
            return
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                try:
                    worker.proc.send_signal(signal.SIGKILL if request > 1 else signum)
                except ProcessLookupError:
                    pass

    # -- health -----------------------------------------------------------------
    def _health_port_file(self, worker: _Worker) -> str:
        return os.path.join(self._progress_dir, f"{worker.instance_id}.health-port")

    def worker_states(self) -> list[WorkerState]:
        """Each worker's process state and health port, for the supervisor's probes (read from their thread)."""
        states = []
        for w in self.workers:
            proc = w.proc
            running = proc is not None and proc.poll() is None
            process: Literal["running", "restarting", "stopped"] = (
                "running" if running else "restarting" if w.restart_at is not None or proc is not None else "stopped"
            )
            port = read_port_file(self._health_port_file(w)) if running else None
            states.append(WorkerState(w.instance_id, process, port, proc.pid if running and proc else None))
        return states

    def serve_health(self) -> HealthServer | None:
        """Open the supervisor's health endpoint (``health``), reporting every worker, and ``/metrics`` there and
        on ``metrics``' port (every worker's, merged: kafkatx.health.worker_metrics); None without ``health``."""
        scrape = self._metrics_route()
        if self.metrics is not None:
            if scrape is None:  # never a flag silently ignored
                raise InvalidConfigurationError(
                    "--metrics-port needs the metrics extra (prometheus_client): pip install 'kafkatx[metrics]'"
                )
            self.metrics_server = HealthServer({"/metrics": scrape}, self.metrics[1], self.metrics[0])
        if self.health is None:
            return None
        addr, port = self.health
        routes = {
            "/livez": lambda: verdict_response(workers_liveness(self.worker_states())),
            "/readyz": lambda: verdict_response(workers_readiness(self.worker_states())),
        }
        if scrape is not None:
            routes["/metrics"] = scrape
        self.health_server = HealthServer(routes, port, addr)
        return self.health_server

    def _metrics_route(self) -> Callable[[], tuple[int, str, bytes]] | None:
        """``/metrics`` of every worker, merged; None without the metrics extra (prometheus_client)."""
        if importlib.util.find_spec("prometheus_client") is None:
            return None
        from kafkatx.health.worker_metrics import CONTENT_TYPE, workers_metrics

        return lambda: (200, CONTENT_TYPE, workers_metrics(self.worker_states()))

    def run(self) -> int:
        """Supervise until a signal or a crash loop; the exit code for ``kafkatx run``."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.health_server is None:
                self.serve_health()
            self.started = True
            for worker in self.workers:
                self._spawn(worker)
            while True:
                if self._requests.count:
                    return self._wait_all()
                verdict = self._check_workers()
                if verdict is not None:
                    return verdict
                if all(w.proc is None and w.restart_at is None for w in self.workers):
                    return self.exit_code  # every worker finished on its own (exit 0)
                time.sleep(0.1)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for server in (self.health_server, self.metrics_server):
                if server is not None:
                    server.stop()
            shutil.rmtree(self._progress_dir, ignore_errors=True)

    def _check_workers(self) -> int | None:
        """One look at every worker: start those whose restart is due, react to those that exited; an exit code
        when one's exit ends the supervisor (its workers are stopped first), else None."""
        now = time.monotonic()
        for worker in self.workers:
            if worker.proc is None:
                if worker.restart_at is not None and now >= worker.restart_at:
                    self._spawn(worker)
                continue
            code = worker.proc.poll()
            if code is None:
                continue
            verdict = self._exited(worker, code, now)
            if verdict is not None:
                self._stop_all()
                return verdict
        return None

    def _exited(self, worker: _Worker, code: int, now: float) -> int | None:
        """React to a worker's exit; an exit code ends the supervisor."""
        worker.proc = None
        if code == 0:
            log.info("worker %s finished", worker.instance_id)
            return None
        if code == EX_CONFIG:
            print(
                f"kafkatx run: worker {worker.instance_id} stopped with a configuration error; not restarting",
                file=sys.stderr,
            )
            return EX_CONFIG
        if worker.progress.moved():
            log.warning(
                "worker %s exited with code %d after making progress; restarting it under the same id in %.0fs",
                worker.instance_id,
                code,
                _FIRST_BACKOFF_S,
            )
            worker.crashes.clear()
            worker.backoff = _FIRST_BACKOFF_S
            worker.restart_at = now + worker.backoff
            return None
        worker.crashes.append(now)
        while worker.crashes and worker.crashes[0] < now - _CRASH_WINDOW_S:
            worker.crashes.popleft()
        if len(worker.crashes) >= _MAX_CRASHES:
            print(
                f"kafkatx run: worker {worker.instance_id} crashed {len(worker.crashes)} times within "
                f"{_CRASH_WINDOW_S:.0f}s (last exit code {code}); giving up",
                file=sys.stderr,
            )
            return 1
        log.warning(
            "worker %s exited with code %d; restarting it under the same id in %.0fs",
            worker.instance_id,
            code,
            worker.backoff,
        )
        worker.restart_at = now + worker.backoff
        worker.backoff = min(worker.backoff * 2, _MAX_BACKOFF_S)
        return None

    def _wait_all(self) -> int:
        deadline = time.monotonic() + self.shutdown_timeout
        code = 0
        for worker in self.workers:
            if worker.proc is None:
                continue
            try:
                exit_code = worker.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                exit_code = worker.proc.wait()
            code = code or (exit_code if exit_code not in (-signal.SIGTERM, -signal.SIGINT) else 0)
        if self._requests.count > 1:  # forced: the workers were killed, as the user asked
            return 128 + self._requests.first_signal
        return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + its number

    def _stop_all(self) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                worker.proc.terminate()
        self._wait_all()


def default_base_id() -> str:
    return os.environ.get("KAFKATX_INSTANCE_ID") or socket.gethostname()
