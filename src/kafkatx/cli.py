"""The kafkatx command: run an App, run a local broker, work with dead-letter topics."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

EX_USAGE = 64
EX_CONFIG = 78


def _broker(args: argparse.Namespace) -> int:
    from kafkatx.local import LocalBroker, LocalBrokerError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        broker = LocalBroker(port=args.port, data_dir=Path(args.data_dir)).start()
    except LocalBrokerError as exc:
        print(f"kafkatx broker: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"kafkatx: local Kafka broker listening on {broker.bootstrap_servers} (data in {broker.data_dir})", flush=True)
        print("press Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if not broker.running:
                print(f"kafkatx broker: the broker exited unexpectedly; log:\n{broker.log_tail()}", file=sys.stderr)
                return 1
    finally:
        broker.stop()
    print("kafkatx: broker stopped", flush=True)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    from kafkatx._version import __version__

    parser = argparse.ArgumentParser(prog="kafkatx", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"kafkatx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("broker", help="run an embedded Kafka broker in the foreground")
    b.add_argument("--port", type=int, default=9092, help="port on 127.0.0.1 (default 9092, where `kafkatx dlq` looks too)")
    b.add_argument("--data-dir", default="./.kafkatx/broker", help="data directory (default ./.kafkatx/broker)")
    b.set_defaults(func=_broker)

    from kafkatx import _cli_run, _cli_topics

    _cli_run.add_parser(sub)
    _cli_topics.add_parsers(sub)
    try:
        from kafkatx.dlq import cli as dlq_cli
    except ImportError:  # pragma: no cover - during development of the dlq tools
        dlq_cli = None  # type: ignore[assignment]
    if dlq_cli is not None and hasattr(dlq_cli, "add_parser"):
        dlq_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2) if args.verbose else logging.INFO
    from kafkatx.logging import configure as configure_logging

    configure_logging(level, json=getattr(args, "log_format", "text") == "json")
    func: Any = args.func
    return int(func(args) or 0)
