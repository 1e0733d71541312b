"""What many test files need: an App on the test broker, and the exception a handler raises for a bad record."""

from __future__ import annotations

from typing import Any

from kafkatx import App
from kafkatx.testing import KafkaTestKit, unique_name


class PoisonError(Exception):
    """What the tests' handlers raise for a record they cannot handle."""


# How the dead-letter headers name it (kafka_dlt-exception-fqcn).
POISON_FQCN = f"{PoisonError.__module__}.{PoisonError.__qualname__}"


def make_app(kafka: KafkaTestKit, *, name: str = "app", instance_id: str = "test", **options: Any) -> App:
    """An App in a fresh consumer group on the test broker; ``options`` go to ``App`` as given."""
    return App(unique_name(name), bootstrap_servers=kafka.bootstrap_servers, instance_id=instance_id, **options)
