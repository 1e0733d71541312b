"""The kafkatx demo: an exactly-once consume-process-produce pipeline on the embedded broker.

It starts a local Kafka broker, writes 1,000 orders (three of them bad), runs
the App from examples/orders.py until every order is committed, and prints
what happened: outputs, dead-lettered records with their headers, committed
offsets and transactions. Everything runs on 127.0.0.1 and is removed at exit.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.orders import app  # noqa: E402
from kafkatx.dlq.headers import parse_dead_letter_headers  # noqa: E402
from kafkatx.events import RecordRecovered, TransactionAborted, TransactionCommitted  # noqa: E402
from kafkatx.local import LocalBroker  # noqa: E402
from kafkatx.testing import committed_offsets, create_topic, end_offsets, produce, read_topic, wait_for  # noqa: E402

N = 1000


def orders() -> list[tuple[bytes, bytes]]:
    rnd = random.Random(7)
    out = []
    for i in range(N):
        order = {"id": i, "qty": rnd.randint(1, 20), "price": round(rnd.uniform(1, 100), 2)}
        if i == 250:
            order["qty"] = 0  # invalid: not retryable, dead-lettered at once
        raw = json.dumps(order).encode()
        if i == 500:
            raw = b"{not json"  # undecodable: dead-lettered at once
        if i == 750:
            order["price"] = "free"  # TypeError in the handler: not retryable by default
            raw = json.dumps(order).encode()
        out.append((str(i).encode(), raw))
    return out


def main() -> None:
    logging.basicConfig(
        level=logging.DEBUG if "-v" in sys.argv else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    tx: Counter[str] = Counter()
    app.on(TransactionCommitted)(lambda e: tx.update([f"committed ({e.kind})"]))
    app.on(TransactionAborted)(lambda e: tx.update(["aborted"]))
    app.on(RecordRecovered)(lambda e: tx.update(["dead-lettered"]))

    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        print(f"embedded Kafka broker at {bs}", flush=True)
        app.bootstrap_servers = bs
        app.instance_id = "demo-1"
        for topic in ("orders", "orders-enriched", "orders-audit"):
            create_topic(bs, topic, partitions=4)
        produce(bs, "orders", orders())
        print(f"produced {N} orders to 'orders' (4 partitions); 3 of them are bad", flush=True)

        started = time.monotonic()
        app.start()
        try:
            wait_for(
                lambda: committed_offsets(bs, "orders", "orders") == end_offsets(bs, "orders"),
                60,
                message="all orders committed",
            )
        finally:
            app.stop()
        elapsed = time.monotonic() - started

        enriched = read_topic(bs, "orders-enriched")
        uncommitted_view = read_topic(bs, "orders-enriched", isolation="read_uncommitted")
        dead = read_topic(bs, "orders-dlt")
        audit = read_topic(bs, "orders-audit")
        ids = Counter(json.loads(r.value or b"{}")["id"] for r in enriched)
        print(f"\nprocessed in {elapsed:.2f}s:")
        print(
            f"  orders-enriched: {len(enriched)} records (read_committed), {len(ids)} distinct order ids, "
            f"duplicates: {sum(c - 1 for c in ids.values())}"
        )
        print(
            f"  orders-enriched seen by read_uncommitted: {len(uncommitted_view)} (a failed attempt's outputs never "
            "reach the broker: the bad orders' work was undone alone, nothing aborted)"
        )
        print(f"  orders-audit (send() inside the handler, same transaction): {len(audit)} large orders")
        print(f"  orders-dlt: {len(dead)} dead-lettered records")
        for r in dead:
            info = parse_dead_letter_headers(r.headers)
            print(
                f"    - {info.original_topic}[{info.original_partition}]@{info.original_offset} "
                f"{info.exception_fqcn}: {info.exception_message} (attempts={info.attempts})"
            )
        print(f"  committed offsets of group 'orders': {committed_offsets(bs, 'orders', 'orders')}")
        print(f"  transactions: {dict(sorted(tx.items()))}")
        ok = len(enriched) == N - 3 and len(ids) == N - 3 and len(dead) == 3
        print("\nexactly-once check:", "OK" if ok else "FAILED")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
