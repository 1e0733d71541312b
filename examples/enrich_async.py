"""Example kafkatx App: an ``async def`` handler that calls a price service, 100 orders in flight at once.

Each order waits about 20 ms for the service; handled one at a time, that caps
the App at 50 orders a second. With ``in_flight=100`` up to 100 of them wait
together, while orders of one customer (one key) are still handled, and their
outputs produced, in input order, and everything stays exactly once
(docs/CONCURRENCY.md). Run it against the embedded broker::

    kafkatx run examples.enrich_async:app --local --local-port 9092

and give it orders from another terminal::

    printf 'c1\t{"sku": "apple", "qty": 3}\nc2\t{"sku": "kiwi", "qty": 1}\n' | kafkatx produce orders-in --kv
    kafkatx dlq inspect orders-in-dlt    # the kiwi order: the service knows no such product

The price service is a small HTTP server this module starts on a free local
port, standing in for yours; the handler talks to it with asyncio streams (use
your HTTP client of choice: aiohttp, httpx).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kafkatx import App, Record

PRICES = {"apple": 0.5, "pear": 0.75, "plum": 1.25}


class _PriceService(BaseHTTPRequestHandler):
    """``GET /price/<sku>``: ``{"price": ...}`` after 20 ms, or 404 for a product it does not know."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(0.02)
        sku = self.path.rsplit("/", 1)[-1]
        known = sku in PRICES
        body = json.dumps({"sku": sku, "price": PRICES.get(sku)}).encode()
        self.send_response(200 if known else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        """Quiet: one line per request would drown the App's own log."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default (5) drops connections when 100 requests arrive at once


def _start_price_service() -> int:
    server = _Server(("127.0.0.1", 0), _PriceService)
    threading.Thread(target=server.serve_forever, name="price-service", daemon=True).start()
    return server.server_address[1]


PRICE_SERVICE_PORT = _start_price_service()


class UnknownProduct(ValueError):
    """The service does not know the product: retrying will not help, so the order is dead-lettered at once."""


async def fetch_price(sku: str) -> float:
    """Ask the price service (one HTTP/1.0 request; the server closes the connection after its answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", PRICE_SERVICE_PORT)
    try:
        writer.write(f"GET /price/{sku} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status == 404:
        raise UnknownProduct(f"no price for {sku!r}")
    if status != 200:
        raise ConnectionError(f"price service answered {status}")  # an outage: the listener waits, nothing counted
    return float(json.loads(body)["price"])


app = App("enrich-async", create_topics=True, topic_partitions=4)


@app.listener(
    "orders-in",
    output="orders-priced",
    in_flight=100,  # up to 100 orders wait for the service at once; one customer's (one key's) one at a time
    max_attempts=3,
    dlq=True,  # orders-in-dlt
    not_retryable=(UnknownProduct,),
)
async def price(record: Record) -> tuple[bytes | None, bytes]:
    """Add the order's total, keeping the customer id as the key."""
    order = json.loads(record.value or b"{}")
    order["total"] = round(order["qty"] * await fetch_price(order["sku"]), 2)
    return record.key, json.dumps(order).encode()
