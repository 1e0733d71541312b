"""Spark servers of this machine for the cluster tests: a standalone master and worker, a Spark Connect server.

Each is started from pyspark's own scripts (``bin/spark-class``, ``bin/spark-submit``), in a process group of its
own, and is ready when it answers (the worker registered at the master; the Connect port accepting): no fixed
waits. The Python workers the executors start get ``PYTHONPATH`` (this checkout's ``src`` and ``tests``), so the
``"kafkatx"`` data source and the test handlers import there as on a real cluster with kafkatx installed.
The fixtures in conftest.py (``spark_standalone``, ``spark_connect``) start one per test run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What the servers' Python workers need on their path, as an installed kafkatx would give them.
WORKER_PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])


def _pyspark_bin(name: str) -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a Spark server process (and of a driver that talks to it)."""
    path = os.pathsep.join(p for p in [WORKER_PYTHONPATH, os.environ.get("PYTHONPATH", "")] if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        **extra,
    }


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait(ready: Callable[[], bool], procs: list[subprocess.Popen[bytes]], log: Path, what: str) -> None:
    deadline = time.monotonic() + 180
    while not ready():
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in 180 s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as answer:
            return int(json.load(answer).get("aliveworkers", 0))
    except OSError:
        return 0


@contextlib.contextmanager
def standalone_cluster(workdir: Path, hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2")) -> Iterator[str]:
    """A standalone master and one 1-core worker per host (loopback addresses); gives the master's ``spark://`` URL.

    Workers on two addresses are two hosts to Spark: a speculative copy of a task runs only on another host."""
    port, ui = _free_port(), _free_port()
    log = workdir / "standalone.log"
    master_class, worker_class = "org.apache.spark.deploy.master.Master", "org.apache.spark.deploy.worker.Worker"
    url = f"spark://127.0.0.1:{port}"
    master = [_pyspark_bin("spark-class"), master_class, "--host", "127.0.0.1", "--port", str(port)]
    procs = [_start([*master, "--webui-port", str(ui)], log, server_env())]
    try:
        _wait(lambda: _accepts(port), procs, log, "the standalone master")
        for n, host in enumerate(hosts):
            worker = [_pyspark_bin("spark-class"), worker_class, url, "--host", host, "--cores", "1", "--memory", "1g"]
            env = server_env(SPARK_LOCAL_IP=host, SPARK_WORKER_DIR=str(workdir / f"work{n}"))
            procs.append(_start([*worker, "--webui-port", str(_free_port())], log, env))
        _wait(lambda: _alive_workers(ui) >= len(hosts), procs, log, "the standalone workers")
        yield url
    finally:
        _stop(procs)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def connect_server(workdir: Path, master: str = "local[2,3]", **conf: str) -> Iterator[str]:
    """A Spark Connect server over ``master`` (its static settings ``conf``); gives its ``sc://`` URL."""
    port = _free_port()
    log = workdir / "connect.log"
    settings = {
        "spark.connect.grpc.binding.port": str(port),
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        **conf,
    }
    command = [_pyspark_bin("spark-submit"), "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    command += ["--master", master, "--name", "kafkatx-tests-connect"]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    procs = [_start(command, log, server_env())]
    try:
        _wait(lambda: _accepts(port), procs, log, "the Spark Connect server")
        yield f"sc://127.0.0.1:{port}"
    finally:
        _stop(procs)
