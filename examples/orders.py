"""Example kafkatx App: enrich orders exactly once; park bad ones on a dead-letter topic.

Run it against the embedded broker (every topic it reads, writes, sends to or
dead-letters to is created for you)::

    kafkatx run examples.orders:app --local --local-port 9092

give it orders from another terminal (``kafkatx produce``, ``topics`` and
``dlq`` find a broker on port 9092 by themselves; without ``--local-port``
pass them the address ``kafkatx run`` prints)::

    printf '1\t{"id": 1, "qty": 2, "price": 3.5}\n2\t{"id": 2, "qty": 0, "price": 1}\n' | kafkatx produce orders --kv
    kafkatx dlq inspect orders-dlt    # order 2: quantity 0, dead-lettered at once

or run it against a cluster::

    KAFKATX_BOOTSTRAP_SERVERS=broker:9092 kafkatx run examples.orders:app --instance-id pod-1
"""

from __future__ import annotations

import json

import tenacity

from kafkatx import App, DeserializationError, Record, send

app = App("orders", create_topics=True, topic_partitions=4)


class InvalidOrder(ValueError):
    """The order is malformed: retrying will not help, so it is dead-lettered at once."""


@app.listener(
    "orders",
    output="orders-enriched",
    sends_to=("orders-audit",),  # checked (and, with create_topics, created) at start like the output
    max_attempts=3,
    backoff=tenacity.wait_exponential(multiplier=0.05, max=1),
    dlq=True,  # failed records go to "orders-dlt" with Spring-compatible headers
    not_retryable=(InvalidOrder,),
    serializer=lambda obj: json.dumps(obj).encode(),
)
def enrich(record: Record) -> dict[str, object]:
    try:
        order = json.loads(record.value or b"")
    except json.JSONDecodeError as exc:
        raise DeserializationError(f"order {record.coordinates} is not JSON") from exc
    if order.get("qty", 0) <= 0:
        raise InvalidOrder(f"order {order.get('id')} has quantity {order.get('qty')}")
    total = round(order["qty"] * order["price"], 2)
    if total >= 1000:
        send("orders-audit", json.dumps({"id": order["id"], "total": total}), key=str(order["id"]))
    return {**order, "total": total}
