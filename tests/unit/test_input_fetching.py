"""The listener consumer's prefetch: librdkafka's 1 s pause after a full local queue is not kafkatx's default."""

from __future__ import annotations

from typing import Any

from kafkatx import App
from kafkatx.app.config import FETCH_QUEUE_BACKOFF_MS


def _config(**listener: Any) -> dict[str, Any]:
    app = App("fetching", bootstrap_servers="127.0.0.1:9", consumer_config=listener.pop("app_consumer", None))

    @app.listener("in", **listener)
    def handle(record: Any) -> None:
        return None

    return app.consumer_config(app.listeners[0], "g", 0)


def test_a_full_queue_is_looked_at_again_within_50_ms_not_a_second() -> None:
    # librdkafka's default (1000) made a listener that empties its queue within the second wait for input: on
    # the embedded broker a third of run 4t0's main flow (docs/BENCHMARKS.md, "Waiting for input").
    assert FETCH_QUEUE_BACKOFF_MS == 50
    assert _config()["fetch.queue.backoff.ms"] == 50


def test_the_users_own_setting_wins() -> None:
    assert _config(consumer_config={"fetch.queue.backoff.ms": 1000})["fetch.queue.backoff.ms"] == 1000
    assert _config(app_consumer={"fetch.queue.backoff.ms": 7})["fetch.queue.backoff.ms"] == 7
