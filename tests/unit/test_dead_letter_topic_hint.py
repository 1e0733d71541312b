"""A dead-letter topic that does not exist (and may not be created) is refused naming the closest existing one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kafkatx import DeadLetterPublishingRecoverer
from kafkatx.errors import InvalidConfigurationError


def test_a_missing_dead_letter_topic_names_the_closest_existing_one() -> None:
    context = SimpleNamespace(
        input_topics=["orders"],
        partitions=lambda topic: 3 if topic in ("orders", "orders-dlq") else None,
        topic_names=lambda: ["orders", "orders-dlq", "__consumer_offsets"],
    )
    with pytest.raises(InvalidConfigurationError, match=r"'orders-dlt' for 'orders' does not exist \(did you mean"):
        DeadLetterPublishingRecoverer(create_topics=False).setup(context)
