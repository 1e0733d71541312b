"""The closest valid name for a misspelt one, shared by every layer (it imports nothing from kafkatx).

A misspelt librdkafka property, command-line flag or topic is refused with
the name the user most likely meant, found the same way everywhere
(difflib's ratio, 0.6 or closer).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest_name", "closest_topic"]


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The name in ``known`` closest to ``name``, or None when none is close enough to suggest."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return close[0] if close else None


def closest_topic(topic: str, existing: Iterable[str]) -> str:
    """`` (did you mean 'orders'?)`` for the existing topic closest to a missing one, or ``""``.

    Kafka's internal topics (``__consumer_offsets``...) are never suggested.
    """
    close = closest_name(topic, (name for name in existing if not name.startswith("__")))
    return f" (did you mean {close!r}?)" if close is not None else ""
