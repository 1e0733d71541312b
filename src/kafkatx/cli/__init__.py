"""The kafkatx command: run an App, run a local broker, create topics and write records, work with dead-letter topics."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kafkatx.cli.parser import CommandParser

__all__ = ["main"]

EX_USAGE = 64
EX_CONFIG = 78
#: Where kafkatx's clients send librdkafka's log lines (kafkatx.client.log, the dead-letter tools).
_CLIENT_LOGGERS = ("kafkatx.librdkafka", "kafkatx.dlq.librdkafka")


def _broker(args: argparse.Namespace) -> int:
    from kafkatx.local import DEFAULT_PORT, LocalBroker, LocalBrokerError, PortInUseError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        broker = LocalBroker(port=args.port, data_dir=Path(args.data_dir)).start()
    except PortInUseError as exc:
        print(
            f"kafkatx broker: port {exc.port} on 127.0.0.1 is already in use. If another `kafkatx broker` "
            f"runs there, use that one (clients reach it at 127.0.0.1:{exc.port}); otherwise pick another "
            "port with --port N",
            file=sys.stderr,
        )
        return 1
    except LocalBrokerError as exc:
        print(f"kafkatx broker: {exc}", file=sys.stderr)
        return 1
    try:
        print(
            f"kafkatx: local Kafka broker listening on {broker.bootstrap_servers} (data in {broker.data_dir})",
            flush=True,
        )
        servers = broker.bootstrap_servers
        found = (
            "kafkatx topics, produce and dlq find it without options; "
            if broker.port == DEFAULT_PORT
            else f"kafkatx topics, produce and dlq: --bootstrap-servers {servers}; "
        )
        print(f"{found}kafkatx run: --bootstrap-servers {servers} (or KAFKATX_BOOTSTRAP_SERVERS={servers})", flush=True)
        print("press Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if not broker.running:
                print(f"kafkatx broker: the broker exited unexpectedly; log:\n{broker.log_tail()}", file=sys.stderr)
                return 1
    finally:
        broker.stop()
    print("kafkatx: broker stopped", flush=True)
    return 0


def _add_verbose(parser: CommandParser) -> None:
    """``-v`` after the command too (``kafkatx run app:app -v``), counted with the one before it.

    Only leaf commands get it: a subcommand's defaults would overwrite what its parent parsed.
    """
    children = parser.subcommands()
    if not children:
        parser.add_argument(
            "-v",
            "--verbose",
            dest="sub_verbose",
            action="count",
            default=0,
            help="more logging: -v kafkatx's debug lines, -vv librdkafka's too",
        )
    for child in children:
        _add_verbose(child)


def _build_parser() -> CommandParser:
    from kafkatx._version import __version__

    parser = CommandParser(prog="kafkatx", description=__doc__)
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more logging: -v kafkatx's debug lines, -vv librdkafka's too",
    )
    parser.add_argument("--version", action="version", version=f"kafkatx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("broker", help="run an embedded Kafka broker in the foreground")
    b.add_argument(
        "--port", type=int, default=9092, help="port on 127.0.0.1 (default 9092, where `kafkatx dlq` looks too)"
    )
    b.add_argument("--data-dir", default="./.kafkatx/broker", help="data directory (default ./.kafkatx/broker)")
    b.set_defaults(func=_broker)

    from kafkatx.cli import run, topics, transactions

    run.add_parser(sub)
    topics.add_parsers(sub)
    transactions.add_parser(sub)
    try:
        from kafkatx.dlq import cli as dlq_cli
    except ImportError:  # pragma: no cover - during development of the dlq tools
        dlq_cli = None  # type: ignore[assignment]
    if dlq_cli is not None and hasattr(dlq_cli, "add_parser"):
        dlq_cli.add_parser(sub)
    for command in parser.subcommands():
        _add_verbose(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default: this process's own command line, ``sys.argv``) and return its exit code.

    ``kafkatx run`` keeps SIGINT/SIGTERM handlers installed once the App has stopped, so that a late copy of the
    stop signal cannot kill the exiting process (kafkatx.app.signals.install_exit_handlers). Called with
    ``argv`` from a program that goes on afterwards, main() puts that program's handlers back before returning.
    """
    if argv is None or threading.current_thread() is not threading.main_thread():
        return _main(argv)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # None: installed outside Python, cannot be put back from here
                signal.signal(sig, handler)


def _main(argv: Sequence[str] | None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.verbosity = args.verbose + getattr(args, "sub_verbose", 0)
    from kafkatx.cli.supervisor import WORKER_ENV
    from kafkatx.logging import configure as configure_logging

    configure_logging(
        logging.DEBUG if args.verbosity > 1 else logging.INFO,
        json=getattr(args, "log_format", "text") == "json",
        instance=os.environ.get(WORKER_ENV),  # set by the supervisor of `kafkatx run --workers`
    )
    if args.verbosity:  # -v: kafkatx's own DEBUG lines; -vv: everything's, librdkafka's included
        logging.getLogger("kafkatx").setLevel(logging.DEBUG)
        for name in _CLIENT_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO if args.verbosity == 1 else logging.DEBUG)
    func: Any = args.func
    return int(func(args) or 0)
