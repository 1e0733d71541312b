"""The SparkSession Spark listeners run on: one per process, created and warmed up
when the App starts (not inside the first transaction), stopped on shutdown.

Spark allows one active SparkContext per process, so the first App to start
creates the session with its settings and later Apps share it; the session is
stopped when the last App using it shuts down. A session passed with
``configure(app, session=...)`` belongs to the caller and is never stopped.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx.errors import InvalidConfigurationError

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["SparkHost", "SparkSettings", "configure", "settings_for", "SessionLease", "ENV_MASTER", "default_conf"]


class SparkHost(Protocol):
    """What Spark listeners need of the App that runs them (kafkatx.App is one)."""

    @property
    def name(self) -> str: ...
    def register(self, spec: ListenerSpec) -> ListenerSpec: ...
    def add_shutdown_hook(self, hook: Callable[[], None]) -> None: ...


log = logging.getLogger("kafkatx.spark")

#: Environment variable that sets the master when configure() did not.
ENV_MASTER = "KAFKATX_SPARK_MASTER"
_LOG_LEVELS = {"ALL", "DEBUG", "ERROR", "FATAL", "INFO", "OFF", "TRACE", "WARN"}


@dataclass(slots=True)
class SparkSettings:
    """How an App's Spark listeners get their SparkSession (see :func:`configure`)."""

    master: str | None = None
    conf: dict[str, str] = field(default_factory=dict)
    app_name: str | None = None
    session: Any = None
    log_level: str = "ERROR"
    warm_up: bool = True

    def resolved_master(self) -> str:
        return self.master or os.environ.get(ENV_MASTER) or "local[*]"


_settings: weakref.WeakKeyDictionary[Any, SparkSettings] = weakref.WeakKeyDictionary()


def configure(
    app: SparkHost,
    *,
    master: str | None = None,
    conf: Mapping[str, Any] | None = None,
    app_name: str | None = None,
    session: Any = None,
    log_level: str = "ERROR",
    warm_up: bool = True,
) -> None:
    """Set how ``app``'s Spark listeners get their SparkSession. Call it before ``app.start()``.

    - ``master``: ``local[*]`` (default, or ``$KAFKATX_SPARK_MASTER``),
      ``local[N]``, ``spark://host:7077``, or ``sc://host:15002`` for Spark
      Connect.
    - ``conf``: extra Spark settings; they win over kafkatx's defaults (see
      :func:`default_conf`).
    - ``app_name``: ``spark.app.name`` (default ``kafkatx-<App name>``).
    - ``session``: use this existing SparkSession instead of creating one;
      kafkatx never stops it (e.g. a test fixture's session).
    - ``log_level``: Spark's log level (``ERROR`` by default; failed tasks
      still log their stack traces at ERROR, ``FATAL`` silences them).
    - ``warm_up``: run a small job at start so the first batch does not pay
      for the JVM's warm-up (class loading, code generation).
    """
    if not callable(getattr(app, "register", None)) or not callable(getattr(app, "add_shutdown_hook", None)):
        raise InvalidConfigurationError(f"kafkatx.spark.configure() needs an App, got {type(app).__name__}")
    if master is not None and (not isinstance(master, str) or not master.strip()):
        raise InvalidConfigurationError(f"master must be a Spark master URL such as 'local[*]', got {master!r}")
    if conf is not None and not isinstance(conf, Mapping):
        raise InvalidConfigurationError(f"conf must be a mapping of Spark settings, got {type(conf).__name__}")
    if session is not None and not callable(getattr(session, "createDataFrame", None)):
        raise InvalidConfigurationError(f"session must be a SparkSession, got {type(session).__name__}")
    if session is not None and (master is not None or conf):
        raise InvalidConfigurationError(
            "pass either session= or master=/conf=, not both: a given session is used as is"
        )
    level = str(log_level).upper()
    if level not in _LOG_LEVELS:
        raise InvalidConfigurationError(f"log_level must be one of {sorted(_LOG_LEVELS)}, got {log_level!r}")
    _settings[app] = SparkSettings(
        master=master,
        conf={str(k): str(v) for k, v in (conf or {}).items()},
        app_name=app_name,
        session=session,
        log_level=level,
        warm_up=warm_up,
    )


def settings_for(app: SparkHost) -> SparkSettings:
    settings = _settings.get(app)
    if settings is None:
        settings = _settings[app] = SparkSettings()
    return settings


def _is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[") or master.startswith("local-cluster")


def default_conf(master: str) -> dict[str, str]:
    """kafkatx's Spark defaults: small batches want few partitions and no UI."""
    cores = os.cpu_count() or 2
    conf = {
        "spark.sql.shuffle.partitions": str(max(1, min(cores, 8))) if _is_local(master) else "8",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    if not master.startswith("sc://"):  # static settings: a Connect client cannot set them
        conf.update({"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"})
    if not _is_local(master) and not master.startswith("sc://"):
        # A task that fails in the handler's code fails its job at once: kafkatx retries the batch by the
        # listener's max_attempts and bisects it to find a poison record, so Spark's own 4 tries per task
        # would only multiply the cost of every failing job (local masters never retry a task).
        conf["spark.task.maxFailures"] = "1"
    return conf


def _set_environment(master: str) -> None:
    # Workers must run this interpreter (where kafkatx, pyarrow and the handler's
    # modules are installed), not whatever `python3` is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if _is_local(master):
        # Only for local masters: a cluster's executors must reach the driver on a real address.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def _build(settings: SparkSettings, default_name: str) -> Any:
    from pyspark.sql import SparkSession

    master = settings.resolved_master()
    if master.startswith("sc://"):
        check_connect_client(master)
    _set_environment(master)
    builder = SparkSession.builder
    builder = builder.remote(master) if master.startswith("sc://") else builder.master(master)
    builder = builder.appName(settings.app_name or default_name)
    for key, value in {**default_conf(master), **settings.conf}.items():
        builder = builder.config(key, value)
    started = time.perf_counter()
    # A SparkContext created on the main thread installs its own SIGINT handler
    # (cancel all jobs, raise KeyboardInterrupt), replacing App.run()'s graceful
    # stop: put the previous handler back.
    main = threading.current_thread() is threading.main_thread()
    previous_sigint = signal.getsignal(signal.SIGINT) if main else None
    try:
        session = builder.getOrCreate()
    except (Exception, SystemExit) as exc:  # some of pyspark's import paths exit when a Connect module is missing
        hint = (
            "is a Spark Connect server listening there?"
            if master.startswith("sc://")
            else ("is Java 17 or 21 installed (JAVA_HOME)?")
        )
        raise InvalidConfigurationError(
            f"could not start a SparkSession with master {master!r}: {type(exc).__name__}: {exc} ({hint})"
        ) from exc
    finally:
        if previous_sigint is not None and signal.getsignal(signal.SIGINT) is not previous_sigint:
            signal.signal(signal.SIGINT, previous_sigint)
    _set_log_level(session, settings.log_level)
    log.info("SparkSession started (master %s) in %.1fs", master, time.perf_counter() - started)
    return session


def check_connect_client(master: str) -> None:
    """Raise InvalidConfigurationError naming what to install when Spark Connect's client packages are missing.

    pyspark's Connect client needs packages of its own (``pyspark[connect]``:
    grpcio, grpcio-status, googleapis-common-protos, zstandard...). Checked
    before the session is built: pyspark's own error for them names one
    package at a time, and some of its import paths end the process instead.
    """
    from importlib import metadata

    try:
        wanted = [r for r in metadata.requires("pyspark") or [] if 'extra == "connect"' in r]
    except metadata.PackageNotFoundError:  # pragma: no cover - pyspark is imported before this is called
        return
    missing = []
    for requirement in wanted:
        spec = requirement.split(";")[0].strip()
        name = re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0]
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(spec)
            continue
        if not _satisfies(spec, installed):
            missing.append(f"{spec} (installed: {installed})")
    if missing:
        raise InvalidConfigurationError(
            f"master {master!r} is Spark Connect, whose client needs packages that are not installed: "
            f"{', '.join(missing)}. Install them with: pip install 'kafkatx[spark-connect]' "
            "(or pip install 'pyspark[connect]' of the installed pyspark's version)"
        )


def _satisfies(requirement: str, version: str) -> bool:
    """Whether ``version`` meets ``requirement`` (True when ``packaging`` is not there to tell)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging comes with pip and pytest
        return True
    return Requirement(requirement).specifier.contains(version, prereleases=True)


def _set_log_level(session: Any, level: str) -> None:
    try:
        session.sparkContext.setLogLevel(level)
    except Exception:  # Spark Connect has no SparkContext
        log.debug("cannot set the Spark log level on this session", exc_info=True)


def _warm_up(session: Any) -> None:
    """Run trivial jobs through the paths every batch takes (Arrow in, a shuffle, Arrow out)."""
    import pyarrow as pa

    started = time.perf_counter()
    try:
        df = session.createDataFrame(pa.table({"x": pa.array([1, 2, 1], pa.int64())}))
        df.groupBy("x").count().toArrow()
    except Exception as exc:
        raise InvalidConfigurationError(
            f"the SparkSession cannot run a trivial job: {type(exc).__name__}: {exc}"
        ) from exc
    log.info("SparkSession warmed up in %.1fs", time.perf_counter() - started)


def _alive(session: Any) -> bool:
    try:
        if getattr(session, "is_stopped", False):  # Spark Connect
            return False
        sc = getattr(session, "_sc", None)
        return sc is None or getattr(sc, "_jsc", None) is not None
    except Exception:
        return False


class _Shared:
    """The process's session, and how many Apps use it."""

    lock = threading.Lock()
    session: Any = None
    owned = False
    users = 0
    creator: tuple[str, SparkSettings] | None = None
    warmed: weakref.WeakSet[Any] = weakref.WeakSet()


class SessionLease:
    """One App's use of the SparkSession: acquired at start, released by the App's shutdown hook."""

    def __init__(self, app: SparkHost) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._session: Any = None
        self._counted = False

    def acquire(self) -> Any:
        """The session, created and warmed up if needed. Idempotent until :meth:`release`."""
        with self._lock:
            if self._session is not None:
                return self._session
            settings = settings_for(self._app)
            if settings.session is not None:
                session, counted = settings.session, False
            else:
                session, counted = self._shared(settings), True
            try:
                if settings.warm_up and session not in _Shared.warmed:
                    _warm_up(session)
                    _Shared.warmed.add(session)
            except BaseException:
                if counted:
                    _release_shared()
                raise
            self._session, self._counted = session, counted
            # Hooks run once per stop, so register again on every start.
            self._app.add_shutdown_hook(self.release)
            return session

    def _shared(self, settings: SparkSettings) -> Any:
        with _Shared.lock:
            if _Shared.session is not None and _alive(_Shared.session):
                if _Shared.creator is not None and _Shared.creator[1] is not settings:
                    name, first = _Shared.creator
                    if (first.master, first.conf) != (settings.master, settings.conf):
                        log.warning(
                            "App %s shares the SparkSession App %s created (one per process); its own "
                            "master/conf settings are ignored",
                            self._app.name,
                            name,
                        )
                _Shared.users += 1
                return _Shared.session
            existing = _existing_session()
            if existing is not None:
                _check_master(existing, settings)
                log.info(
                    "using the SparkSession that already exists in this process (master %s; kafkatx will not stop it)",
                    _master_of(existing) or "unknown",
                )
                _Shared.session, _Shared.owned = existing, False
            else:
                _Shared.session = _build(settings, f"kafkatx-{self._app.name}")
                _Shared.owned = True
            _Shared.creator = (self._app.name, settings)
            _Shared.users = 1
            return _Shared.session

    def release(self) -> None:
        """Give the session back; the last App to release a session kafkatx created stops it."""
        with self._lock:
            session, counted = self._session, self._counted
            self._session, self._counted = None, False
        if session is not None and counted:
            _release_shared()


def _release_shared() -> None:
    with _Shared.lock:
        _Shared.users = max(0, _Shared.users - 1)
        if _Shared.users or _Shared.session is None:
            return
        session, owned = _Shared.session, _Shared.owned
        _Shared.session, _Shared.owned, _Shared.creator = None, False, None
    if owned:
        started = time.perf_counter()
        try:
            session.stop()
        except Exception:
            log.warning("stopping the SparkSession failed", exc_info=True)
        log.info("SparkSession stopped in %.1fs", time.perf_counter() - started)


def _master_of(session: Any) -> str | None:
    """The master of a classic SparkSession; None for a Spark Connect one (no SparkContext on the client)."""
    try:
        return str(session.sparkContext.master)
    except Exception:
        return None


def _check_master(existing: Any, settings: SparkSettings) -> None:
    """A master asked for (``configure(master=...)`` or ``$KAFKATX_SPARK_MASTER``) that the SparkSession already
    running in this process does not have is an error: a process has one SparkContext, and running the jobs
    elsewhere than asked without a word would be worse."""
    wanted = settings.master or os.environ.get(ENV_MASTER)
    actual = _master_of(existing)
    if wanted and actual is not None and actual != wanted:
        raise InvalidConfigurationError(
            f"a SparkSession with master {actual!r} already runs in this process, and kafkatx was asked for "
            f"master {wanted!r} (kafkatx.spark.configure(master=...) or ${ENV_MASTER}); a process has one "
            "SparkContext: pass session= to use the running one, stop it before the App starts, or leave master unset"
        )


def _existing_session() -> Any:
    try:
        from pyspark.sql import SparkSession
    except ImportError:  # pragma: no cover
        return None
    session = SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)
    return session if session is not None and _alive(session) else None
