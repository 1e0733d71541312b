"""``kafkatx run module:attr``: run an App from the command line."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import sys
from typing import Any

from kafkatx.errors import InvalidConfigurationError, KafkaTxError

__all__ = ["add_parser", "load_app"]

log = logging.getLogger("kafkatx.cli")

EX_USAGE = 64
EX_CONFIG = 78


def load_app(target: str) -> Any:
    """Import ``module:attr`` (``attr`` may be an App or a zero-argument factory returning one)."""
    from kafkatx.app import App

    module_name, sep, attr = target.partition(":")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        dotted = module_name.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
        raise ValueError(
            f"{module_name!r} is a file path; kafkatx run takes a module name: try {dotted}:{attr or 'app'} "
            "(run it from the directory that contains the module)"
        )
    if not sep or not module_name or not attr:
        raise ValueError(f"expected module:attribute (for example examples.orders:app), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ValueError(f"cannot import module {module_name!r}: {exc}") from exc
        raise
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
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


def _supervise(args: argparse.Namespace) -> int:
    """``--workers N``: the same command once per worker, each with its own instance id, supervised."""
    from kafkatx._supervisor import Supervisor, default_base_id, worker_ids

    command = [sys.executable, "-m", "kafkatx", "run", args.target, "--no-status", "--log-format", args.log_format]
    if args.create_topics:
        command.append("--create-topics")
    broker = None
    try:
        if args.local:
            from kafkatx.local import LocalBroker, LocalBrokerError

            try:
                broker = LocalBroker(port=args.local_port, data_dir=args.local_data_dir).start()
            except LocalBrokerError as exc:
                print(f"kafkatx run: {exc}", file=sys.stderr)
                return 1
            print(f"kafkatx: embedded broker at {broker.bootstrap_servers}", flush=True)
            command += ["--bootstrap-servers", broker.bootstrap_servers, "--create-topics", "--embedded-broker"]
        elif args.bootstrap_servers:
            command += ["--bootstrap-servers", args.bootstrap_servers]
        ids = worker_ids(args.instance_id or default_base_id(), args.workers)
        print(f"kafkatx: supervising {args.workers} workers: {', '.join(ids)}", flush=True)
        return Supervisor(command, ids).run()
    finally:
        if broker is not None:
            broker.stop()


def _run(args: argparse.Namespace) -> int:
    if args.workers is not None:
        if args.workers < 1:
            print("kafkatx run: --workers must be at least 1", file=sys.stderr)
            return EX_USAGE
        return _supervise(args)
    try:
        app = load_app(args.target)
    except InvalidConfigurationError as exc:  # raised while the module declared its listeners
        print(f"kafkatx run: configuration error: {exc}", file=sys.stderr)
        return EX_CONFIG
    except ValueError as exc:
        print(f"kafkatx run: {exc}", file=sys.stderr)
        return EX_USAGE
    if args.instance_id:
        app.instance_id = args.instance_id
    if args.bootstrap_servers:
        app.bootstrap_servers = args.bootstrap_servers
    if args.create_topics:
        app.create_topics = True
    broker = None
    try:
        if args.local:
            from kafkatx.local import LocalBroker, LocalBrokerError

            try:
                broker = LocalBroker(port=args.local_port, data_dir=args.local_data_dir).start()
            except LocalBrokerError as exc:
                print(f"kafkatx run: {exc}", file=sys.stderr)
                return 1
            app.bootstrap_servers = broker.bootstrap_servers
            app.create_topics = True  # a fresh embedded broker has no topics yet
            for key, value in LocalBroker.client_config.items():
                app.config.setdefault(key, value)
            print(f"kafkatx: embedded broker at {broker.bootstrap_servers}", flush=True)
        elif args.embedded_broker:  # a worker of a supervisor that runs the embedded broker
            from kafkatx.local import LocalBroker

            for key, value in LocalBroker.client_config.items():
                app.config.setdefault(key, value)
        if args.metrics_port is not None:
            from kafkatx.metrics import serve_metrics

            server = serve_metrics(app, args.metrics_port, args.metrics_addr)
            print(f"kafkatx: metrics at {server.url}", flush=True)
        status = None
        if args.status or (args.status is None and sys.stderr.isatty()):
            try:
                from kafkatx._status import StatusLine

                status = StatusLine(app).start()
            except ImportError:
                status = None
        try:
            app.run()
        finally:
            if status is not None:
                status.stop()
    except InvalidConfigurationError as exc:
        print(f"kafkatx run: configuration error: {exc}", file=sys.stderr)
        return EX_CONFIG
    except KeyboardInterrupt:
        return 130
    except KafkaTxError as exc:  # kafkatx's messages say what happened and what to check
        print(f"kafkatx run: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"kafkatx run: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if broker is not None:
            broker.stop()
    return 0


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="run an App: kafkatx run module:app")
    r.add_argument("target", help="module:attribute of a kafkatx.App (or a function returning one)")
    r.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (default: the App's, or $KAFKATX_BOOTSTRAP_SERVERS)")
    r.add_argument("--instance-id", help="stable identity of this process, used in transactional.ids ($KAFKATX_INSTANCE_ID)")
    r.add_argument("--local", action="store_true",
                   help="start an embedded Kafka broker for the lifetime of the process; it replaces the App's "
                        "bootstrap servers, and missing topics are created")  # fmt: skip
    r.add_argument("--local-port", type=int, default=None, help="port of the embedded broker (default: a free one)")
    r.add_argument("--local-data-dir", default=None, help="data dir of the embedded broker (default: temporary)")
    r.add_argument("--create-topics", action="store_true", help="create missing input/output topics")
    r.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: a free one)")
    r.add_argument("--metrics-addr", default="127.0.0.1", help="address to serve metrics on (default 127.0.0.1; 0.0.0.0 for all)")
    r.add_argument("--log-format", choices=("text", "json"), default="text", help="log as text (default) or one JSON object per line")
    r.add_argument("--status", dest="status", action="store_true", default=None, help="show a live status line")
    r.add_argument("--no-status", dest="status", action="store_false", help="never show the live status line")
    r.add_argument("--workers", type=int, default=None, metavar="N",
                   help="run N worker processes (instance ids <id>-0..<id>-N-1) under a supervisor that "
                        "restarts a crashed worker under its id and forwards signals")  # fmt: skip
    r.add_argument("--embedded-broker", action="store_true", help=argparse.SUPPRESS)
    r.set_defaults(func=_run)
