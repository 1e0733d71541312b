"""Back-off between delivery attempts, expressed as tenacity wait strategies."""

from __future__ import annotations

from typing import Any

import tenacity
from tenacity.wait import wait_base

__all__ = ["Backoff", "as_wait"]

Backoff = wait_base | float | int | None


def as_wait(backoff: Any) -> wait_base | None:
    """Accept a tenacity wait strategy, a number of seconds, or None (no wait)."""
    if backoff is None:
        return None
    if isinstance(backoff, bool):
        raise TypeError("backoff must be a tenacity wait strategy or a number of seconds, not a bool")
    if isinstance(backoff, (int, float)):
        if backoff < 0:
            raise ValueError(f"backoff must be >= 0 seconds, got {backoff}")
        return tenacity.wait_fixed(backoff) if backoff else None
    if isinstance(backoff, wait_base) or callable(backoff):
        return backoff  # type: ignore[no-any-return]
    raise TypeError(
        f"backoff must be a tenacity wait strategy (wait_fixed, wait_exponential, ...) or seconds, got {backoff!r}"
    )
