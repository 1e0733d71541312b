"""The container's time limits, worked out once from the listener's options and its consumer configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["fence_hold", "transaction_budget"]


def transaction_budget(spec: ListenerSpec, transaction_timeout_ms: int, consumer_config: dict[str, Any]) -> float:
    """Seconds of handling after which a transaction takes no more records (``max_transaction_ms``).

    By default a third of the smaller of the transaction timeout and
    max.poll.interval.ms: slow handlers then split a big poll over several
    transactions instead of outliving the broker's transaction timeout or
    being thrown out of the group.
    """
    if spec.max_transaction_ms is not None:
        return spec.max_transaction_ms / 1000.0
    max_poll = int(consumer_config.get("max.poll.interval.ms", 300_000))
    return min(transaction_timeout_ms, max_poll) / 3000.0


def fence_hold(consumer_config: dict[str, Any]) -> float:
    """Seconds to hold a partition after fencing: two heartbeats (a consumer dropped from its
    group learns it from the next heartbeat response), plus a second, at most a session timeout."""
    heartbeat = int(consumer_config.get("heartbeat.interval.ms", 3000)) / 1000.0
    session = int(consumer_config.get("session.timeout.ms", 45_000)) / 1000.0
    return min(session, 2 * heartbeat + 1.0)
