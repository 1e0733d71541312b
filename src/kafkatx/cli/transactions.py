"""``kafkatx transactions abort module:app``: abort what the App's own transactional ids left open.

For a hanging transaction (read_committed readers stuck below the high watermark of a topic the App writes):
see kafkatx.app.open_transactions. Exit 0 once every id was re-initialised, 1 if one could not be.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser"]


def _abort(args: argparse.Namespace) -> int:
    from kafkatx.app.open_transactions import abort_open_transactions
    from kafkatx.cli.run import load_app
    from kafkatx.errors import KafkaTxError

    try:
        app = load_app(args.target)
    except (ImportError, ValueError) as exc:
        print(f"kafkatx transactions abort: {exc}", file=sys.stderr)
        return 1
    if args.instance_id:
        app.instance_id = args.instance_id
    if args.bootstrap_servers:
        app.bootstrap_servers = args.bootstrap_servers
    try:
        ids = abort_open_transactions(app, producers=args.producers)
    except KafkaTxError as exc:
        print(f"kafkatx transactions abort: {exc}", file=sys.stderr)
        return 1
    for txn_id in ids:
        print(f"re-initialised {txn_id}: anything it left open is aborted", flush=True)
    return 0


def _count(text: str) -> int:
    """A whole number of ids, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more, got {text!r}")
    return int(text)


def add_parser(sub: Any) -> None:
    t = sub.add_parser("transactions", help="the App's transactions: abort what its transactional ids left open")
    commands = t.add_subparsers(dest="transactions_command", required=True, metavar="COMMAND")
    a = commands.add_parser(
        "abort",
        help="re-initialise each transactional id the App uses (aborting what it left open, fencing its "
        "producer); run it while the App is stopped",
    )
    a.add_argument("target", help="module:attribute of a kafkatx.App (or a function returning one)")
    a.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (default: the App's)")
    a.add_argument("--instance-id", help="the instance id the App runs with (its ids with fencing='group' name it)")
    a.add_argument(
        "--producers",
        type=_count,
        default=4,
        help="how many of app.transaction()'s per-thread ids to re-initialise too (default 4)",
    )
    a.set_defaults(func=_abort)
