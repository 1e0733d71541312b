"""The rules of ``/livez`` and ``/readyz``, over snapshots of an App's containers.

Pure functions of plain values (:class:`ContainerState`, :class:`ListenerState`),
so each rule is tested without a broker; :mod:`kafkatx.health.snapshot` reads
the states from a running App.

Liveness answers "would restarting the process help?": a container thread
that ended (an error stopped it) or is stuck in a client call well past its
deadline: a bounded producer call kafkatx should have abandoned, or, between
batches, a ``consume()`` that has not returned long after its timeout (the
poll of at most 0.5 s, plus the time a batch listener waits to fill its
batch; rebalance callbacks run inside it). A slow handler never makes a
container not live: a Spark job may legitimately run for minutes, and a
restart would only run it again; readiness says so instead.

Readiness answers "is this replica doing its share?": every container has
started and received its assignment from the group (an empty one counts: a
replica with more consumers than partitions is still ready, or a rolling
update would never complete), none has been handling one batch for longer
than ``not_ready_after``, none owns a partition that fetches nothing while
records are behind (:class:`~kafkatx.listener.loop.health.StallCheck`), and the
listener has not been paused (a dependency outage, ``app.pause``) for longer
than ``not_ready_after``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kafkatx._validate import is_int
from kafkatx.errors import InvalidConfigurationError

__all__ = [
    "DEFAULT_NOT_READY_AFTER",
    "STUCK_CALL_GRACE_S",
    "ContainerState",
    "ListenerState",
    "Verdict",
    "check_health_options",
    "container_liveness",
    "container_readiness",
    "liveness",
    "readiness",
]

#: Seconds a listener may be stuck on one batch, or paused, and still be ready.
DEFAULT_NOT_READY_AFTER = 60.0
#: Seconds past its deadline a bounded client call may still be in progress before its container is not live
#: (kafkatx abandons such a call at its deadline: one still in progress long after means that did not happen).
STUCK_CALL_GRACE_S = 30.0


def check_health_options(port: object, addr: object, not_ready_after: object) -> None:
    """An :class:`~kafkatx.InvalidConfigurationError` naming the first bad health option."""
    if port is not None and not is_int(port, 0, 65535):
        raise InvalidConfigurationError(f"health_port must be an integer in 0..65535 (0: a free one), got {port!r}")
    if not isinstance(addr, str) or not addr:
        raise InvalidConfigurationError(f"health_addr must be a host address such as '127.0.0.1', got {addr!r}")
    if (
        isinstance(not_ready_after, bool)
        or not isinstance(not_ready_after, (int, float))
        or not math.isfinite(not_ready_after)
        or not_ready_after <= 0
    ):
        raise InvalidConfigurationError(
            f"not_ready_after must be a positive number of seconds, got {not_ready_after!r}"
        )


@dataclass(frozen=True)
class ContainerState:
    """What the probes need to know of one container, read at one moment."""

    name: str
    #: "starting" (its thread not started yet), "running" (thread alive) or "stopped" (thread ended).
    thread: str
    #: The consumer is open and polling (or the container failed trying).
    opened: bool = False
    failure: str | None = None
    #: The group gave this container its assignment (maybe empty) since it started.
    assignment_received: bool = False
    #: Seconds since no broker of ``cluster`` answers the container; None while one does.
    unreachable_for: float | None = None
    cluster: str = ""
    partitions: int = 0
    #: Seconds it has been handling the current batch; None between batches.
    handling_for: float | None = None
    #: Owned partitions that fetch nothing although records are behind, as ``topic[partition]``.
    stalled: tuple[str, ...] = ()
    #: ``retry="topics"``: retry partitions whose first due record was not consumed for a check interval, as
    #: ``topic[partition]``. Said in ``/readyz``'s body; the container stays ready (docs/RETRY_TOPICS.md).
    stalled_retry: tuple[str, ...] = ()
    #: The bounded client call its thread is blocked in: what, for how long, and its deadline (seconds).
    blocked_call: str | None = None
    blocked_for: float = 0.0
    blocked_deadline: float | None = None
    #: Seconds since its thread last returned from ``consume()``, while it is between batches; None while it
    #: handles one, or before it opened its consumer.
    since_poll: float | None = None
    #: The seconds ``consume()`` may take between batches (its timeout, and the filling of a batch).
    poll_deadline: float = 0.5


@dataclass(frozen=True)
class ListenerState:
    name: str
    containers: tuple[ContainerState, ...]
    #: Seconds the listener has been held by an outage or ``app.pause``; None if it is not.
    held_for: float | None = None


@dataclass(frozen=True)
class Verdict:
    """A probe's answer: ``ok`` (HTTP 200, else 503) and the JSON body that says why."""

    ok: bool
    body: dict[str, Any]

    @property
    def status(self) -> int:
        return 200 if self.ok else 503


def container_liveness(c: ContainerState, grace: float = STUCK_CALL_GRACE_S) -> str | None:
    """Why ``c`` is not live, or None if it is."""
    if c.thread == "stopped":
        return f"stopped by {c.failure}" if c.failure else "stopped"
    if c.blocked_call is not None and c.blocked_deadline is not None and c.blocked_for > c.blocked_deadline + grace:
        return (
            f"blocked in {c.blocked_call} for {c.blocked_for:.0f}s, past its {c.blocked_deadline:.3g}s deadline "
            "(the call was not abandoned)"
        )
    if c.blocked_call is None and c.since_poll is not None and c.since_poll > c.poll_deadline + grace:
        return (
            f"has not returned from consume() for {c.since_poll:.0f}s between batches, past its "
            f"{c.poll_deadline:.3g}s timeout"
        )
    return None


def container_readiness(c: ContainerState, not_ready_after: float, grace: float = STUCK_CALL_GRACE_S) -> str | None:
    """Why ``c`` is not ready, or None if it is."""
    dead = container_liveness(c, grace)
    if dead is not None:
        return dead
    if c.thread == "starting" or not c.opened:
        return "starting"
    if c.unreachable_for is not None and c.unreachable_for > not_ready_after:
        return f"no broker of {c.cluster or 'the cluster'} has answered for {c.unreachable_for:.0f}s"
    if not c.assignment_received:
        return "waiting for its partition assignment from the group (and its partitions' producers)"
    if c.handling_for is not None and c.handling_for > not_ready_after:
        return f"handling one batch for {c.handling_for:.0f}s, longer than not_ready_after={not_ready_after:g}s"
    if c.stalled:
        return f"owns {', '.join(c.stalled)}, which fetch(es) nothing although records are behind"
    return None


def liveness(listeners: Sequence[ListenerState], grace: float = STUCK_CALL_GRACE_S) -> Verdict:
    """``/livez``: live while no container thread ended or is stuck in a client call (before start: live)."""
    body: list[dict[str, Any]] = []
    for listener in listeners:
        rows = []
        for c in listener.containers:
            reason = container_liveness(c, grace)
            rows.append({"container": c.name, "live": reason is None, **({"reason": reason} if reason else {})})
        body.append({"listener": listener.name, "live": all(r["live"] for r in rows), "containers": rows})
    ok = all(row["live"] for row in body)
    started = any(listener.containers for listener in listeners)
    return Verdict(ok, {"status": ("live" if started else "starting") if ok else "not live", "listeners": body})


def readiness(
    listeners: Sequence[ListenerState],
    not_ready_after: float = DEFAULT_NOT_READY_AFTER,
    grace: float = STUCK_CALL_GRACE_S,
) -> Verdict:
    """``/readyz``: ready when every listener's containers have their assignment and none is stuck or held."""
    body: list[dict[str, Any]] = []
    for listener in listeners:
        rows = []
        for c in listener.containers:
            reason = container_readiness(c, not_ready_after, grace)
            row: dict[str, Any] = {"container": c.name, "ready": reason is None, "partitions": c.partitions}
            if reason:
                row["reason"] = reason
            if c.stalled_retry:
                row["stalled_retry_partitions"] = list(c.stalled_retry)
            rows.append(row)
        reasons = [f"{r['container']}: {r['reason']}" for r in rows if "reason" in r]
        if not listener.containers:
            reasons.append("not started")
        if listener.held_for is not None and listener.held_for > not_ready_after:
            reasons.append(
                f"paused for {listener.held_for:.0f}s (a dependency outage or app.pause), "
                f"longer than not_ready_after={not_ready_after:g}s"
            )
        entry: dict[str, Any] = {"listener": listener.name, "ready": not reasons}
        if listener.held_for is not None:
            entry["paused_for"] = round(listener.held_for, 1)
        if reasons:
            entry["reasons"] = reasons
        entry["containers"] = rows
        body.append(entry)
    ok = bool(body) and all(entry["ready"] for entry in body)
    return Verdict(ok, {"status": "ready" if ok else "not ready", "listeners": body})
