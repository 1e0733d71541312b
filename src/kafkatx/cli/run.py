"""``kafkatx run module:attr``: run an App from the command line."""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from kafkatx.app import startup
from kafkatx.app.signals import install_exit_handlers
from kafkatx.cli.progress import report_progress
from kafkatx.errors import ClusterUnreachableError, InvalidConfigurationError, KafkaTxError
from kafkatx.health.checks import check_health_options
from kafkatx.tracing import require_opentelemetry

__all__ = ["add_parser", "load_app"]

log = logging.getLogger("kafkatx.cli")

EX_USAGE = 64
EX_CONFIG = 78

#: The kafkatx extra that installs a module an App (or one of kafkatx's examples) may import.
_EXTRAS = {
    "sqlalchemy": "database",
    "pyspark": "spark",
    "pyarrow": "spark",
    "pandas": "spark",
    "prometheus_client": "metrics",
    "noida_db": "local",
}
#: Python words in kafkatx's messages, and what a user of this command types instead.
_CLI_WORDS = (
    (
        "pass App(create_topics=True) to let kafkatx create missing topics",
        "run with --create-topics (App(create_topics=True)) to let kafkatx create missing topics",
    ),
)


class MissingDependencyError(Exception):
    """The App's module imports a package that is not installed (exit 78: reinstalling fixes it, restarting does not)."""


def _file_path_hint(module_name: str, attr: str) -> str:
    """What to type instead of a file path: the dotted module name when it is under the current directory."""
    path = Path(module_name.replace("\\", "/"))
    if path.suffix == ".py":
        path = path.with_suffix("")
    absolute = (Path.cwd() / path).resolve()
    try:
        relative = absolute.relative_to(Path.cwd().resolve())
    except ValueError:  # outside the current directory: run from the file's own directory
        return f"try: cd {absolute.parent} && kafkatx run {absolute.name}:{attr or 'app'}"
    return f"try {'.'.join(relative.parts)}:{attr or 'app'} (from this directory)"


def check_target(target: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``module:attr``, or a ValueError saying what to type instead."""
    module_name, sep, attr = target.partition(":")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        raise ValueError(
            f"{module_name!r} is a file path; kafkatx run takes a module name, without .py: "
            + _file_path_hint(module_name, attr)
        )
    if not sep or not module_name or not attr:
        example = f"{module_name}:app" if module_name and not sep else "examples.orders:app"
        raise ValueError(f"expected module:attribute, got {target!r}: try {example}")
    return module_name, attr


def _import(module_name: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(
                f"cannot import module {module_name!r}: {exc} (run kafkatx from the directory "
                "that contains it, or install it)"
            ) from exc
        top = missing.split(".")[0]
        extra = _EXTRAS.get(top)
        how = (
            f"pip install 'kafkatx[{extra}]' (in a clone of kafkatx: pip install -e '.[{extra}]')"
            if extra
            else f"install the package that provides it (often: pip install {top})"
        )
        raise MissingDependencyError(f"{module_name} imports {missing!r}, which is not installed: {how}") from exc


def _misspelt_keyword(exc: TypeError) -> str | None:
    """One line for ``Output(vaule=...)`` and the like: a kafkatx class given an unknown keyword (App checks
    its own options and raises InvalidConfigurationError, with the closest name).

    Python's own TypeError names neither the file nor the closest option;
    other TypeErrors (the App's code) are left alone, traceback and all.
    """
    match = re.fullmatch(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(exc))
    if match is None:
        return None
    import kafkatx

    cls = getattr(kafkatx, match.group(1), None)
    if not inspect.isclass(cls) or cls.__init__.__qualname__ != f"{match.group(1)}.__init__":
        return None
    known = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    close = difflib.get_close_matches(match.group(2), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(known)}"
    return f"{_where(exc)}{match.group(1)}() got an unknown option {match.group(2)!r}{hint}"


def _where(exc: BaseException) -> str:
    """``file:line: `` of the App's own line that led to ``exc`` (the last frame outside kafkatx and importlib)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # src/kafkatx/
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(package)
    ]
    return f"{os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}: " if frames else ""


def load_app(target: str) -> Any:
    """Import ``module:attr`` (``attr`` may be an App or a zero-argument factory returning one)."""
    from kafkatx.app import App

    module_name, attr = check_target(target)
    module = _import(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            apps = [name for name, value in vars(module).items() if isinstance(value, App)]
            found = (
                f": try {module_name}:{apps[0]}"
                if len(apps) == 1
                else (f"; its Apps are {', '.join(apps)}" if apps else "")
            )
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}{found}") from None
    if not isinstance(obj, App) and callable(obj):
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise ValueError(f"{target} is not a kafkatx.App, nor a factory that takes no arguments") from None
        except ValueError:  # no signature (a builtin): not one of ours
            raise ValueError(f"{target} is a {type(obj).__name__}, not a kafkatx.App") from None
        obj = obj()
    if not isinstance(obj, App):
        raise ValueError(f"{target} is a {type(obj).__name__}, not a kafkatx.App")
    return obj


def _cli_words(message: str) -> str:
    for python, cli in _CLI_WORDS:
        message = message.replace(python, cli)
    return message


def _local_broker_line(bootstrap_servers: str) -> str:
    from kafkatx.local import DEFAULT_PORT

    tools = (
        "kafkatx topics, produce and dlq find it without options"
        if bootstrap_servers.endswith(f":{DEFAULT_PORT}")
        else f"for kafkatx topics, produce and dlq: --bootstrap-servers {bootstrap_servers}"
    )
    return f"kafkatx: embedded broker at {bootstrap_servers} ({tools})"


def _start_local_broker(args: argparse.Namespace) -> Any:
    """The embedded broker of ``--local``, announced on stdout; or None after printing why it could not start."""
    from kafkatx.local import LocalBroker, LocalBrokerError, PortInUseError

    try:
        broker = LocalBroker(port=args.local_port, data_dir=args.local_data_dir).start()
    except PortInUseError as exc:
        print(
            f"kafkatx run: the embedded broker cannot listen on port {exc.port}: it is already in use on "
            "127.0.0.1 (another broker?). Pick another --local-port, or leave --local-port out for a free "
            "one",
            file=sys.stderr,
        )
        return None
    except LocalBrokerError as exc:
        print(f"kafkatx run: {exc}", file=sys.stderr)
        return None
    print(_local_broker_line(broker.bootstrap_servers), flush=True)
    return broker


def _supervise(args: argparse.Namespace) -> int:
    """``--workers N``: the same command once per worker, each with its own instance id, supervised."""
    problem = _unimportable(args.target)
    if problem is not None:  # a target that cannot work would make every worker exit at once: say so once
        print(f"kafkatx run: {problem}", file=sys.stderr)
        return EX_USAGE
    command = _worker_command(args)
    broker = None
    try:
        if args.local:
            broker = _start_local_broker(args)
            if broker is None:
                return 1
            command += ["--bootstrap-servers", broker.bootstrap_servers, "--create-topics", "--embedded-broker"]
        elif args.bootstrap_servers:
            command += ["--bootstrap-servers", args.bootstrap_servers]
        return _start_supervisor(command, args)
    finally:
        if broker is not None:
            broker.stop()


def _unimportable(target: str) -> str | None:
    """Why ``target`` cannot name a module, or None: asked once, before any worker starts (each would exit at
    once on it), with find_spec, not an import (the workers import it)."""
    try:
        module_name, _ = check_target(target)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        if importlib.util.find_spec(module_name) is None:
            raise ValueError(f"cannot import module {module_name!r}: No module named {module_name!r}")
    except (ValueError, ImportError) as exc:
        return str(exc)
    return None


def _worker_command(args: argparse.Namespace) -> list[str]:
    """The command line of each worker: this one's options that a worker takes as they are, without the
    status line; with ``--health-port``, a free port on 127.0.0.1 (the supervisor serves the one asked for)."""
    command = [sys.executable, "-m", "kafkatx", "run", args.target, "--no-status", "--log-format", args.log_format]
    command += ["-v"] * min(getattr(args, "verbosity", 0), 2)
    if args.create_topics:
        command.append("--create-topics")
    if args.tracing:
        command.append("--tracing")
    if args.not_ready_after is not None:
        command += ["--not-ready-after", repr(args.not_ready_after)]
    if args.health_port is not None or args.metrics_port is not None:  # each worker reports the free port it got
        command += ["--health-port", "0", "--health-addr", "127.0.0.1"]  # (its /metrics too: the supervisor merges)
    return command


def _start_supervisor(command: list[str], args: argparse.Namespace) -> int:
    """Supervise ``--workers`` copies of ``command`` until they stop; the exit code (none is started when the
    supervisor's own health port cannot be opened)."""
    from kafkatx.cli.supervisor import Supervisor, default_base_id, worker_ids

    health = None if args.health_port is None else (args.health_addr, args.health_port)
    metrics = None if args.metrics_port is None else (args.metrics_addr, args.metrics_port)
    ids = worker_ids(args.instance_id or default_base_id(), args.workers)
    supervisor = Supervisor(command, ids, health=health, metrics=metrics)
    try:
        server = supervisor.serve_health()
    except InvalidConfigurationError as exc:  # the port is in use: say so once, start no worker
        print(f"kafkatx run: configuration error: {exc}", file=sys.stderr)
        return EX_CONFIG
    if server is not None:
        print(f"kafkatx: health probes of every worker at {server.url} (/livez, /readyz)", flush=True)
    if supervisor.metrics_server is not None:
        print(f"kafkatx: metrics of every worker at {supervisor.metrics_server.url}/metrics", flush=True)
    print(f"kafkatx: supervising {args.workers} workers: {', '.join(ids)}", flush=True)
    install_exit_handlers(lambda: supervisor.started)
    return supervisor.run()


def _no_servers(app: Any) -> str:
    """What to do when the App has no bootstrap servers, in this command's words."""
    from kafkatx.client.brokers import port_in_use
    from kafkatx.local import DEFAULT_PORT  # read at call time: tests point it at their broker

    running = (
        (
            f" (something listens on 127.0.0.1:{DEFAULT_PORT}, where `kafkatx broker` runs: "
            f"--bootstrap-servers 127.0.0.1:{DEFAULT_PORT})"
        )
        if port_in_use(DEFAULT_PORT)
        else ""
    )
    return (
        f"App {app.name!r} has no Kafka bootstrap servers: pass --bootstrap-servers HOST:PORT, set "
        f"$KAFKATX_BOOTSTRAP_SERVERS, or add --local for an embedded broker{running}"
    )


def _unreachable(app: Any, args: argparse.Namespace, reason: str) -> str:
    servers = app.resolved_bootstrap_servers()
    source = (
        "--bootstrap-servers"
        if args.bootstrap_servers
        else "the App's bootstrap_servers"
        if app.bootstrap_servers or app.config.get("bootstrap.servers")
        else "$KAFKATX_BOOTSTRAP_SERVERS"
    )
    if reason.startswith("cannot resolve host"):
        return f"{reason.partition(': is the name')[0]}, from {source}: is the name right? Pass --bootstrap-servers HOST:PORT"
    return (
        f"cannot reach Kafka at {servers} (from {source}; no answer within {startup.STARTUP_METADATA_TIMEOUT_S:g} s): "
        "is the broker running, "
        "and is that its address? Pass --bootstrap-servers HOST:PORT, or add --local for an embedded broker"
    )


def _run(args: argparse.Namespace) -> int:
    if args.workers is not None:
        if args.workers < 1:
            print("kafkatx run: --workers must be at least 1", file=sys.stderr)
            return EX_USAGE
        return _supervise(args)
    app = _load(args.target)
    if isinstance(app, int):
        return app
    refused = _apply_options(app, args)
    if refused is not None:
        return refused
    broker = None
    try:
        if args.local:
            broker = _start_local_broker(args)
            if broker is None:
                return 1
            app.bootstrap_servers = broker.bootstrap_servers
            app.create_topics = True  # a fresh embedded broker has no topics yet
        if args.local or args.embedded_broker:  # --embedded-broker: a worker of a supervisor that runs one
            from kafkatx.local import LocalBroker

            for key, value in LocalBroker.client_config.items():
                app.config.setdefault(key, value)
        return _serve(app, args)
    except (Exception, KeyboardInterrupt) as exc:
        return _failed(exc, app, args)
    finally:
        if broker is not None:
            broker.stop()


def _apply_options(app: Any, args: argparse.Namespace) -> int | None:
    """Set the command's options on the App, over its own; the exit code after printing why one is refused
    (``--tracing`` without OpenTelemetry, a bad ``--not-ready-after``), else None."""
    if args.instance_id:
        app.instance_id = args.instance_id
    if args.bootstrap_servers:
        app.bootstrap_servers = args.bootstrap_servers
    if args.create_topics:
        app.create_topics = True
    if args.tracing and app.tracing is False:  # the App's own provider, if it names one, is kept
        try:
            require_opentelemetry()
            _require_opentelemetry_sdk()
        except InvalidConfigurationError as exc:
            print(f"kafkatx run: --tracing: {exc}", file=sys.stderr)
            return EX_CONFIG
        app.tracing = True
    if args.not_ready_after is not None:  # replaces the App's not_ready_after
        try:
            check_health_options(None, "127.0.0.1", args.not_ready_after)
        except InvalidConfigurationError as exc:
            print(f"kafkatx run: --not-ready-after: {exc}", file=sys.stderr)
            return EX_CONFIG
        app.not_ready_after = args.not_ready_after
    return None


def _require_opentelemetry_sdk() -> None:
    """Refuse ``--tracing`` without an OpenTelemetry SDK, which would trace nothing and say nothing.

    It takes the global TracerProvider, which stays the API's no-op one unless an SDK is installed (and
    configured, by the application or opentelemetry-instrument): no span would ever be exported.
    """
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        raise InvalidConfigurationError(
            "no OpenTelemetry SDK is installed, so no span would ever be exported: pip install 'kafkatx[otel]' "
            "opentelemetry-sdk and an exporter (e.g. opentelemetry-exporter-otlp), and configure them in the "
            "application or run under opentelemetry-instrument"
        )


def _load(target: str) -> Any:
    """The App ``target`` names, or the exit code after printing why it could not be loaded."""
    try:
        return load_app(target)
    except InvalidConfigurationError as exc:  # raised while the module made its App and declared its listeners
        print(f"kafkatx run: configuration error: {_where(exc)}{exc}", file=sys.stderr)
        return EX_CONFIG
    except MissingDependencyError as exc:
        print(f"kafkatx run: {exc}", file=sys.stderr)
        return EX_CONFIG
    except TypeError as exc:
        misspelt = _misspelt_keyword(exc)
        if misspelt is None:
            raise
        print(f"kafkatx run: configuration error: {misspelt}", file=sys.stderr)
        return EX_CONFIG
    except ValueError as exc:
        print(f"kafkatx run: {exc}", file=sys.stderr)
        return EX_USAGE


def _serve(app: Any, args: argparse.Namespace) -> int:
    """Run the App with the command's metrics server and status line until it stops."""
    try:
        app.resolved_bootstrap_servers()
    except InvalidConfigurationError:
        print(f"kafkatx run: configuration error: {_no_servers(app)}", file=sys.stderr)
        return EX_CONFIG
    if args.metrics_port is not None:
        from kafkatx.metrics import serve_metrics

        server = serve_metrics(app, args.metrics_port, args.metrics_addr)
        print(f"kafkatx: metrics at {server.url}", flush=True)
    if args.health_port is not None:  # replaces the App's health_port; App.start() leaves an open one alone
        from kafkatx.health import serve_health
        from kafkatx.health.workers import report_health_port

        app.health_server = serve_health(app, args.health_port, args.health_addr)
        print(f"kafkatx: health probes at {app.health_server.url} ({', '.join(app.health_server.routes)})", flush=True)
        report_health_port(app.health_server.port)  # to a supervisor (--workers), if there is one
    report_progress(app)  # to a supervisor (--workers), if there is one
    status = None
    if args.status or (args.status is None and sys.stderr.isatty()):
        try:
            from kafkatx.cli.status import StatusLine

            status = StatusLine(app).start()
        except ImportError:
            status = None
    install_exit_handlers(lambda: bool(app.containers))  # app.run() puts them back when it returns
    try:
        app.run()
    finally:
        if status is not None:
            status.stop()
    return 0


def _failed(exc: BaseException, app: Any, args: argparse.Namespace) -> int:
    """The exit code of a run that ``exc`` ended, after saying why in one line."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, InvalidConfigurationError):
        print(f"kafkatx run: configuration error: {_cli_words(str(exc))}", file=sys.stderr)
        return EX_CONFIG
    if isinstance(exc, ClusterUnreachableError):
        print(f"kafkatx run: {_unreachable(app, args, str(exc))}", file=sys.stderr)
    elif isinstance(exc, KafkaTxError):  # kafkatx's messages say what happened and what to check
        print(f"kafkatx run: {_cli_words(str(exc))}", file=sys.stderr)
    else:
        print(f"kafkatx run: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="run an App: kafkatx run module:app", usage_exit_code=EX_USAGE)
    r.add_argument("target", help="module:attribute of a kafkatx.App (or a function returning one)")
    r.add_argument(
        "--bootstrap-servers", help="Kafka bootstrap servers (default: the App's, or $KAFKATX_BOOTSTRAP_SERVERS)"
    )
    r.add_argument(
        "--instance-id", help="stable identity of this process, used in transactional.ids ($KAFKATX_INSTANCE_ID)"
    )
    r.add_argument(
        "--local",
        action="store_true",
        help="start an embedded Kafka broker for the lifetime of the process; it replaces the App's "
        "bootstrap servers, and missing topics are created (as with --create-topics)",
    )
    r.add_argument("--local-port", type=int, default=None, help="port of the embedded broker (default: a free one)")
    r.add_argument("--local-data-dir", default=None, help="data dir of the embedded broker (default: temporary)")
    r.add_argument(
        "--create-topics",
        action="store_true",
        help="create the missing topics the App reads, writes, sends to or dead-letters to "
        "(with the App's topic_partitions)",
    )
    r.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: a free one)"
    )
    r.add_argument(
        "--metrics-addr", default="127.0.0.1", help="address to serve metrics on (default 127.0.0.1; 0.0.0.0 for all)"
    )
    r.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /livez, /readyz (and /metrics with the metrics extra) on this port (0: a free one); "
        "with --workers, the supervisor's port reports every worker",
    )
    r.add_argument("--health-addr", default="127.0.0.1", help="address to serve health probes on (default 127.0.0.1)")
    r.add_argument(
        "--not-ready-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="/readyz says not ready once a listener is stuck on one batch, or paused, for longer than this "
        "(default: the App's not_ready_after, 60 s)",
    )
    r.add_argument(
        "--tracing",
        action="store_true",
        help="trace each record's processing with OpenTelemetry (the kafkatx[otel] extra; the SDK and exporter "
        "are configured by the application or the environment, e.g. opentelemetry-instrument)",
    )
    r.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log as text (default) or one JSON object per line",
    )
    r.add_argument("--status", dest="status", action="store_true", default=None, help="show a live status line")
    r.add_argument("--no-status", dest="status", action="store_false", help="never show the live status line")
    r.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="run N worker processes (instance ids <id>-0..<id>-N-1) under a supervisor that "
        "restarts a crashed worker under its id and forwards signals",
    )
    r.add_argument("--embedded-broker", action="store_true", help=argparse.SUPPRESS)
    r.set_defaults(func=_run)
