"""What many test files need: an App on the test broker, and the exception a handler raises for a bad record."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from kafkatx import App
from kafkatx.testing import KafkaTestKit, unique_name, wait_for


class PoisonError(Exception):
    """What the tests' handlers raise for a record they cannot handle."""


# How the dead-letter headers name it (kafka_dlt-exception-fqcn).
POISON_FQCN = f"{PoisonError.__module__}.{PoisonError.__qualname__}"


def summed_counts(records: list[Any]) -> Counter[str]:
    """The totals of per-batch counts (key: a word, value: its count in one batch), as the word count produces them."""
    total: Counter[str] = Counter()
    for r in records:
        total[(r.key or b"").decode()] += int(r.value or b"0")
    return total


def make_app(kafka: KafkaTestKit, *, name: str = "app", instance_id: str = "test", **options: Any) -> App:
    """An App in a fresh consumer group on the test broker; ``options`` go to ``App`` as given."""
    return App(unique_name(name), bootstrap_servers=kafka.bootstrap_servers, instance_id=instance_id, **options)


def client_threads() -> frozenset[int]:
    """This process's librdkafka threads (``threading`` does not list them; their names start ``rdk:``). Linux only."""
    threads = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text()
        except OSError:  # ended meanwhile
            continue
        if name.startswith("rdk"):
            threads.add(int(tid))
    return frozenset(threads)


def wait_for_client_threads_to_end(before: frozenset[int], timeout: float = 10) -> None:
    """Wait until the librdkafka threads started since ``before = client_threads()`` have ended: from then on
    nothing they printed can still arrive (their raw log lines come from those threads). Threads of other
    clients that live on (a fixture's, an earlier test's) do not count."""

    def ended() -> bool:
        return not (client_threads() - before)

    wait_for(ended, timeout, message="the clients' librdkafka threads ended")
