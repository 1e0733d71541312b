"""Reads the probes' states (:mod:`kafkatx.health.checks`) from a running App, through public members only.

Typed against small Protocols, not the App and its containers: the App
imports this package (``App(health_port=...)``), so this package must not
import it back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from kafkatx.client.bounded import CallInProgress
from kafkatx.client.offsets import TP
from kafkatx.health.checks import ContainerState, ListenerState

__all__ = ["POLL_TIMEOUT_S", "ContainerView", "HealthSource", "container_state", "listener_states"]

#: The longest a container's ``consume()`` waits for records (its loop's poll timeout; a held listener's is shorter).
POLL_TIMEOUT_S = 0.5


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Polled(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def max_batch_ms(self) -> int: ...


class _Held(Protocol):
    def held_for(self) -> float | None: ...


class _Reachability(Protocol):
    bootstrap_servers: str

    def down_for(self, now: float) -> float | None: ...


class ContainerLife(Protocol):
    """What liveness reads of a container: its thread, its failure, and whether its loop still turns."""

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> _Polled: ...
    @property
    def thread(self) -> threading.Thread | None: ...
    @property
    def polled_at(self) -> float: ...
    @property
    def alive(self) -> bool: ...
    @property
    def failure(self) -> BaseException | None: ...
    @property
    def handling_since(self) -> float | None: ...
    def blocked_call(self) -> CallInProgress | None: ...


class ContainerReadiness(Protocol):
    """What readiness reads of a container: started, its partitions, and whether its cluster answers."""

    @property
    def started(self) -> threading.Event: ...
    @property
    def brokers(self) -> _Reachability: ...
    @property
    def assignment_received(self) -> threading.Event: ...
    @property
    def assignment(self) -> set[TP]: ...
    @property
    def stalled_partitions(self) -> frozenset[TP]: ...
    @property
    def stalled_retry_partitions(self) -> frozenset[TP]: ...


class ContainerView(ContainerLife, ContainerReadiness, Protocol):
    """What the probes read of a :class:`~kafkatx.listener.loop.container.ListenerContainer`."""


class HealthSource(Protocol):
    """What the probes read of a :class:`kafkatx.App`."""

    @property
    def listeners(self) -> Sequence[_Named]: ...
    @property
    def containers(self) -> Sequence[ContainerView]: ...
    @property
    def not_ready_after(self) -> float: ...
    def listener_outage(self, listener: str) -> _Held: ...


def container_state(c: ContainerView, now: float | None = None) -> ContainerState:
    now = time.monotonic() if now is None else now
    thread = c.thread
    failure = c.failure
    call = c.blocked_call()
    since = c.handling_since
    opened = c.started.is_set()
    state = "starting" if thread is None else "running" if thread.is_alive() else "stopped"
    polling = opened and state == "running" and since is None  # between batches: in or around consume()
    return ContainerState(
        name=c.name,
        thread=state,
        opened=opened,
        failure=None if failure is None else f"{type(failure).__name__}: {failure}",
        assignment_received=c.assignment_received.is_set(),
        unreachable_for=c.brokers.down_for(now),
        cluster=c.brokers.bootstrap_servers,
        partitions=len(c.assignment),
        handling_for=None if since is None else max(0.0, now - since),
        stalled=tuple(f"{t}[{p}]" for t, p in sorted(c.stalled_partitions)),
        stalled_retry=tuple(f"{t}[{p}]" for t, p in sorted(c.stalled_retry_partitions)),
        blocked_call=None if call is None else call.operation,
        blocked_for=0.0 if call is None else call.seconds,
        blocked_deadline=None if call is None else call.deadline,
        since_poll=max(0.0, now - c.polled_at) if polling else None,
        poll_deadline=POLL_TIMEOUT_S + c.spec.max_batch_ms / 1000.0,
    )


def listener_states(app: HealthSource) -> list[ListenerState]:
    """Every listener of ``app`` with the states of its containers (none before the App started)."""
    now = time.monotonic()
    containers = list(app.containers)
    states = []
    for spec in list(app.listeners):
        mine = tuple(container_state(c, now) for c in containers if c.spec.name == spec.name)
        held = app.listener_outage(spec.name).held_for()
        states.append(ListenerState(spec.name, mine, held))
    return states
