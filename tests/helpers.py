"""What many test files need: an App on the test broker, and the exception a handler raises for a bad record."""

from __future__ import annotations

import os
from typing import Any

from kafkatx import App
from kafkatx.testing import KafkaTestKit, unique_name, wait_for


class PoisonError(Exception):
    """What the tests' handlers raise for a record they cannot handle."""


# How the dead-letter headers name it (kafka_dlt-exception-fqcn).
POISON_FQCN = f"{PoisonError.__module__}.{PoisonError.__qualname__}"


def make_app(kafka: KafkaTestKit, *, name: str = "app", instance_id: str = "test", **options: Any) -> App:
    """An App in a fresh consumer group on the test broker; ``options`` go to ``App`` as given."""
    return App(unique_name(name), bootstrap_servers=kafka.bootstrap_servers, instance_id=instance_id, **options)


def os_threads() -> int:
    """This process's threads, librdkafka's included (which ``threading`` does not list). Linux only."""
    return len(os.listdir("/proc/self/task"))


def wait_for_client_threads_to_end(before: int, timeout: float = 10) -> None:
    """Wait until the threads of the clients made since ``before = os_threads()`` have ended: from then on
    nothing they printed can still arrive (their raw log lines come from those threads)."""
    wait_for(lambda: os_threads() <= before, timeout, message=f"back to {before} threads (the clients closed)")
