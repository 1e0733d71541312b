"""An embedded single-node Kafka broker for development and tests.

kafkatx's zero-setup default is the ``noida-db`` broker from PyPI (the ``local``
extra). :class:`LocalBroker` runs its binary directly, bound to 127.0.0.1, and
owns the process: it is stopped by PID, and it can never outlive the
interpreter that started it (atexit handler plus ``PR_SET_DEATHSIG``).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType

from kafkatx.client.brokers import (  # chained_listeners and warn_about_chained_listeners re-exported
    EMBEDDED_CLUSTER_ID,
    EMBEDDED_CLUSTER_ID_PREFIX,
    REIDENTIFIED_CLUSTER_ID_PREFIX,
    chained_listeners,
    live_brokers,
    port_in_use,
    track,
    untrack,
    warn_about_chained_listeners,
)
from kafkatx.client.brokers import local_broker_at as _running_broker_at

__all__ = [
    "LocalBroker",
    "LocalBrokerError",
    "PortInUseError",
    "chained_listeners",
    "find_noida_binary",
    "local_broker_at",
    "warn_about_chained_listeners",
]

log = logging.getLogger("kafkatx.local")

_INSTALL_HINT = "pip install 'kafkatx[local]'"

#: The port `kafkatx broker` listens on unless told otherwise.
DEFAULT_PORT = 9092


class LocalBrokerError(RuntimeError):
    """The embedded broker could not be found, started or stopped."""


class PortInUseError(LocalBrokerError):
    """The port asked for is taken (often by another broker). The commands reword the hint in their own options."""

    def __init__(self, port: int) -> None:
        super().__init__(
            f"cannot start the local broker: port {port} on 127.0.0.1 is already in use (is another broker "
            "running?); pick another port, or LocalBroker(port=None) for a free one"
        )
        self.port = port


def find_noida_binary() -> Path:
    """Return the path of the noida-db binary shipped in the ``noida-db`` wheel."""
    spec = importlib.util.find_spec("noida_db")
    if spec is None or not spec.submodule_search_locations:
        raise LocalBrokerError(
            "the embedded Kafka broker needs the 'local' extra (the noida-db package), "
            f"which is not installed; install it with: {_INSTALL_HINT}"
        )
    binary = Path(next(iter(spec.submodule_search_locations))) / "noida-db"
    if not binary.is_file():
        raise LocalBrokerError(
            f"noida-db is installed but its binary is missing at {binary}; "
            f"reinstall it with: {_INSTALL_HINT} --force-reinstall"
        )
    if not os.access(binary, os.X_OK):
        raise LocalBrokerError(f"the noida-db binary at {binary} is not executable (chmod +x it)")
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_broker_at(bootstrap_servers: str) -> LocalBroker | None:
    """The running :class:`LocalBroker` of this process that ``bootstrap_servers`` names, if any.

    An embedded broker started in another process (``kafkatx broker``) is
    not recognised: it looks like any other cluster from here.
    """
    broker = _running_broker_at(bootstrap_servers)
    return broker if isinstance(broker, LocalBroker) else None


_TEMP_PREFIX = "kafkatx-broker-"
#: In a temporary data dir: the pid of the process that owns it.
_OWNER_FILE = ".kafkatx-owner"


def _remove_orphaned_temporary_dirs() -> None:
    """Remove the temporary data dirs of owners that died without stopping their broker.

    A process killed with SIGKILL (or by the OOM killer) takes its broker with
    it (``PR_SET_DEATHSIG``) but runs no cleanup, so its temporary directory
    would stay forever. The next start removes it: only directories whose
    owner file names a process that no longer exists.
    """
    for directory in Path(tempfile.gettempdir()).glob(f"{_TEMP_PREFIX}*"):
        try:
            pid = int((directory / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or being created right now
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except OSError:  # PermissionError: alive, another user's
            continue


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_DEATHSIG
    except Exception:  # pragma: no cover - non-Linux
        pass


#: noida-db's snapshot file in its data dir; it holds the cluster id, among the rest of the broker's state.
_SNAPSHOT = "kafka.json"


def _seed_cluster_id(data_dir: Path) -> None:
    """Give a broker starting on an empty data dir a cluster id of its own.

    noida-db 0.2.3 reports the same cluster id from every fresh start, so a
    database that keeps consumed positions (``database=``) could not tell one
    temporary broker from the next, and would trust positions written for
    another broker's log. It restores the id from its snapshot file, so an
    empty snapshot carrying a fresh id gives every new broker its own; a data
    dir that already has a snapshot keeps its id (the same broker, restarted),
    unless that is still the shared one (:func:`_reidentify_shared_cluster_id`).
    """
    snapshot = data_dir / _SNAPSHOT
    if snapshot.exists():
        _reidentify_shared_cluster_id(snapshot)
        return
    cluster_id = EMBEDDED_CLUSTER_ID_PREFIX + _random_id()
    state = {
        "topics": [],
        "broker_id": 1,
        "host": "127.0.0.1",
        "port": 0,
        "cluster_id": cluster_id,
        "next_producer_id": 1000,
        "committed_offsets": [],
        "offset_metadata": [],
        "broker_configs": {},
    }
    snapshot.write_text(json.dumps(state))


def _random_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")


def _reidentify_shared_cluster_id(snapshot: Path) -> None:
    """Give a kept data dir that still has noida-db's shared cluster id one of its own, once, and say so.

    Such a data dir was made before kafkatx seeded ids (``--local-data-dir``
    kept across upgrades). Its new id tells a database that the positions it
    stored for the shared id belong to this broker
    (:func:`kafkatx.client.identity.succeeds_shared_id`): they are kept, and
    tied to the new id on their next use; another broker's are refused from
    then on. A snapshot that cannot be read or written is left as it is.
    """
    try:
        state = json.loads(snapshot.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(state, dict) or state.get("cluster_id") != EMBEDDED_CLUSTER_ID:
        return
    state["cluster_id"] = cluster_id = REIDENTIFIED_CLUSTER_ID_PREFIX + _random_id()
    written = snapshot.with_name(snapshot.name + ".kafkatx-new")
    try:
        written.write_text(json.dumps(state))
        os.replace(written, snapshot)
    except OSError as exc:
        log.warning("the broker data dir %s keeps noida-db's shared cluster id: %s", snapshot.parent, exc)
        return
    log.warning(
        "the broker data dir %s had noida-db's shared cluster id %s (made by an earlier kafkatx); it now has one "
        "of its own, %s. Positions a database= listener stored for the shared id are kept and tied to the new id "
        "on their next use.",
        snapshot.parent,
        EMBEDDED_CLUSTER_ID,
        cluster_id,
    )


class LocalBroker:
    """A noida-db Kafka broker on 127.0.0.1, owned by this process.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`.
    ``port=None`` picks a free port; ``data_dir=None`` uses a temporary
    directory that is removed on :meth:`stop` (or, when this process is
    killed before it can stop the broker, by the next start of any
    LocalBroker). :meth:`restart` keeps the
    data directory and the port, so clients reconnect to the same address.
    """

    #: Client properties for this broker. noida-db 0.2.3 sometimes answers a fetch
    #: with every record it holds, ignoring fetch.max.bytes; past librdkafka's default
    #: receive.message.max.bytes (100 MB) the consumer would retry that fetch forever.
    client_config: Mapping[str, object] = MappingProxyType({"receive.message.max.bytes": 1_000_000_000})

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise LocalBrokerError(f"port must be an integer in 1..65535, got {port!r}")
        self._requested_port = port
        self._port: int | None = port
        self._owns_data_dir = data_dir is None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: object | None = None
        self._lock = threading.RLock()

    # -- properties -------------------------------------------------------
    @property
    def port(self) -> int:
        """The port the broker listens on (a LocalBrokerError before the first start when none was given)."""
        if self._port is None:
            raise LocalBrokerError("the broker has not been started")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:<port>``, for the ``bootstrap.servers`` client setting."""
        return f"127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        """The broker's data directory (a temporary one unless ``data_dir`` was given)."""
        if self._data_dir is None:
            raise LocalBrokerError("the broker has not been started")
        return self._data_dir

    @property
    def pid(self) -> int | None:
        """The broker process's id, None when it is not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the broker process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        """The broker's own log file, in its data directory (:meth:`log_tail` reads its end)."""
        return self.data_dir / "broker.log"

    # -- lifecycle --------------------------------------------------------
    def start(self) -> "LocalBroker":
        """Start the broker and block until it answers metadata requests."""
        with self._lock:
            if self.running:
                return self
            binary = find_noida_binary()
            self._prepare_data_dir()
            try:
                return self._start_in_data_dir(binary)
            except BaseException:
                self._drop_owned_data_dir()  # a failed start leaves no empty temporary directory behind
                raise

    def _start_in_data_dir(self, binary: Path) -> "LocalBroker":
        with self._lock:
            attempts = 3 if self._requested_port is None else 1
            for attempt in range(1, attempts + 1):
                if self._requested_port is None and (self._port is None or attempt > 1):
                    self._port = _free_port()
                elif port_in_use(self.port):
                    raise PortInUseError(self.port)
                try:
                    self._spawn(binary)
                    self._wait_ready()
                    break
                except LocalBrokerError:
                    self._terminate()
                    if attempt == attempts:
                        raise
                    log.warning("local broker failed to start on port %s, retrying on another port", self._port)
            track(self)
            log.info("local Kafka broker up at %s (pid %s, data %s)", self.bootstrap_servers, self.pid, self._data_dir)
            return self

    def stop(self) -> None:
        """Stop the broker: SIGTERM, then SIGKILL after ``stop_timeout``. Idempotent."""
        with self._lock:
            self._terminate()
            untrack(self)
            self._drop_owned_data_dir()

    def _drop_owned_data_dir(self) -> None:
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            if self._requested_port is None:
                self._port = None

    def restart(self) -> "LocalBroker":
        """Stop and start again on the same port, keeping the data directory."""
        with self._lock:
            self._terminate()
            return self.start()

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would. The data directory is kept."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._close_log()

    def __enter__(self) -> "LocalBroker":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"running at {self.bootstrap_servers}" if self.running else "stopped"
        return f"<LocalBroker {state}>"

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the broker's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no broker log)"
        kept = [ln for ln in text.splitlines() if "weak version" not in ln]  # harmless glibc notice
        return "\n".join(kept[-lines:]) or "(broker log is empty)"

    # -- internals --------------------------------------------------------
    def _prepare_data_dir(self) -> None:
        if self._data_dir is None:
            _remove_orphaned_temporary_dirs()
            self._data_dir = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))
            (self._data_dir / _OWNER_FILE).write_text(str(os.getpid()))
            _seed_cluster_id(self._data_dir)
            return
        try:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            probe = self._data_dir / ".kafkatx-write-probe"
            probe.write_bytes(b"")
            probe.unlink()
            _seed_cluster_id(self._data_dir)
        except OSError as exc:
            raise LocalBrokerError(
                f"the broker data dir {str(self._data_dir)!r} cannot be written: {exc.strerror or exc}"
            ) from exc

    def _spawn(self, binary: Path) -> None:
        cmd = [
            str(binary),
            "start",
            "--only",
            "kafka",
            "--kafka-port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--data-dir",
            str(self.data_dir),
        ]
        self._close_log()
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _close_log
        self._log_file = log_file
        in_main = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # The death signal fires when the *thread* that forked exits, so only
            # arm it from the main thread; atexit covers the other cases.
            preexec_fn=_die_with_parent if in_main else None,
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        delay = 0.005
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise LocalBrokerError(
                    f"the local broker exited with code {self._proc.returncode} during startup "
                    f"(port {self._port}); broker log:\n{self.log_tail()}"
                )
            if self._metadata_answers():
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        raise LocalBrokerError(
            f"the local broker did not answer metadata on {self.bootstrap_servers} within "
            f"{self.startup_timeout:.0f}s; broker log:\n{self.log_tail()}"
        )

    def _metadata_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
        except OSError:
            return False
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        try:
            admin.list_topics(timeout=2)
            return True
        except Exception:
            return False

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("local broker pid %s ignored SIGTERM for %.0fs; killing it", proc.pid, self.stop_timeout)
                proc.kill()
                proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            with contextlib.suppress(Exception):
                self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None


@atexit.register
def _stop_all() -> None:
    for broker in live_brokers():
        if not isinstance(broker, LocalBroker):
            continue
        with contextlib.suppress(Exception):
            broker.stop()
