"""Static membership on the embedded broker, which never removes a static member that stopped.

On Apache Kafka a static member (``group.instance.id``, KIP-345) that stops
keeps its partitions for ``session.timeout.ms``, then the broker removes it:
plain configuration, nothing for kafkatx to do. The embedded broker never
removes it (docs/BROKERS.md), so after a clean stop of ``--instance-id pod-1``
a run under other ids (``--workers 2``: ``pod-1-0``, ``pod-1-1``) got no
partition at all, and going back got 1 of 4. On the embedded broker only,
kafkatx therefore takes each container's static member out of the group when
the container stops cleanly (a LeaveGroup by instance id, which it honours).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from kafkatx.client.brokers import is_embedded_broker
from kafkatx.client.membership import LeaveGroupError, leave_group
from kafkatx.client.offsets import TP

__all__ = [
    "GroupLook",
    "StaleMemberWatch",
    "leave_group_on_clean_stop",
    "stale_member_message",
    "watch_for_stale_members",
]

log = logging.getLogger("kafkatx.app")


class StoppedContainer(Protocol):
    """What a container that has just stopped tells about its membership."""

    @property
    def name(self) -> str: ...
    @property
    def group_id(self) -> str: ...
    @property
    def stop_reason(self) -> str: ...
    @property
    def consumer_config(self) -> Mapping[str, Any]: ...


def leave_group_on_clean_stop(bootstrap_servers: str, cluster_id: str | None, container: StoppedContainer) -> None:
    """On the embedded broker, remove a cleanly stopped container's static member from its group.

    Only after a normal stop: a container stopped because another live
    process took over its ``group.instance.id`` must not remove that
    process's membership, and a crashed one is restarted under its id.
    """
    instance = container.consumer_config.get("group.instance.id")
    if not instance or container.stop_reason != "normal" or not is_embedded_broker(bootstrap_servers, cluster_id):
        return
    try:
        leave_group(bootstrap_servers, container.group_id, [str(instance)])
    except LeaveGroupError as exc:
        log.warning(
            "listener %s: could not leave group %r as static member %r (%s): on the embedded broker its "
            "partitions stay with that member until a process with the same instance id starts again",
            container.name,
            container.group_id,
            instance,
            exc,
        )
        return
    log.debug("listener %s left group %r as static member %r", container.name, container.group_id, instance)


#: When the stale-member check samples the groups after a start: two looks, so that "no progress" means something.
STALE_CHECK_AT_S = (3.0, 7.0)


class GroupLook(NamedTuple):
    """One look at a group: its state, its static members' partitions, committed offsets, records waiting."""

    state: str
    members: dict[str, tuple[TP, ...]]  # group.instance.id -> its partitions (static members only)
    committed: dict[TP, int]
    waiting: set[TP]  # partitions with records after their committed offset


class StaleMemberWatch:
    """Says within seconds of a start when static members left behind on the embedded broker strand partitions.

    A clean stop leaves the group (above); a killed process cannot, and a run
    under other instance ids afterwards (another worker count, another
    ``--instance-id``) would find the dead members holding partitions, or the
    group waiting for them to rejoin, in silence. The check runs twice after
    a start (:data:`STALE_CHECK_AT_S`) and warns, naming the members, their
    partitions and the command that removes them, when a static member that
    is not this App's holds partitions whose records wait and whose committed
    offsets did not move between the looks, or when the group was rebalancing
    at both looks while such members were in it.
    """

    def __init__(self, admin_config: Mapping[str, Any], bootstrap_servers: str, groups: Mapping[str, Groups]) -> None:
        self._admin_config = dict(admin_config)
        self._bootstrap = bootstrap_servers
        self._groups = groups  # group id -> (this App's instance ids, the topics it reads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kafkatx-stale-members", daemon=True)
        self.warnings: list[str] = []

    def start(self) -> StaleMemberWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            from confluent_kafka.admin import AdminClient

            admin = AdminClient({**self._admin_config, "log_level": 0})
            started, samples = time.monotonic(), []
            for at in STALE_CHECK_AT_S:
                if self._stop.wait(max(0.0, started + at - time.monotonic())):
                    return
                samples.append({group: _sample(admin, group, topics) for group, (_, topics) in self._groups.items()})
            for group, (ours, _) in self._groups.items():
                message = stale_member_message(group, ours, samples[0][group], samples[1][group], self._bootstrap)
                if message is not None and not self._stop.is_set():
                    self.warnings.append(message)
                    log.warning("%s", message)
        except Exception:  # noqa: BLE001 - a diagnosis must never disturb the App
            log.debug("stale static member check failed", exc_info=True)


#: Per group: this App's static instance ids in it, and the topics its listeners read there.
Groups = tuple[frozenset[str], tuple[str, ...]]


def _sample(admin: Any, group: str, topics: tuple[str, ...]) -> GroupLook:
    from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, TopicPartition
    from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

    described = admin.describe_consumer_groups([group], request_timeout=3)[group].result()
    members = {
        str(m.group_instance_id): tuple((tp.topic, tp.partition) for tp in m.assignment.topic_partitions)
        for m in described.members
        if m.group_instance_id
    }
    metadata = admin.list_topics(timeout=3)
    tps = [TopicPartition(t, p) for t in topics if t in metadata.topics for p in metadata.topics[t].partitions]
    if not tps:
        return GroupLook(str(described.state), members, {}, set())
    offsets = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, tps)], request_timeout=3)
    committed = {(tp.topic, tp.partition): tp.offset for tp in offsets[group].result().topic_partitions}
    level = IsolationLevel.READ_COMMITTED
    latest, earliest = OffsetSpec.latest(), OffsetSpec.earliest()  # type: ignore[no-untyped-call]
    ends = admin.list_offsets({tp: latest for tp in tps}, isolation_level=level, request_timeout=3)
    starts = admin.list_offsets({tp: earliest for tp in tps}, isolation_level=level, request_timeout=3)
    waiting = set()
    for tp in tps:
        key = (tp.topic, tp.partition)
        position = committed.get(key, -1)
        if position < 0:
            position = starts[tp].result().offset
        if ends[tp].result().offset > position:
            waiting.add(key)
    return GroupLook(str(described.state), members, committed, waiting)


def stale_member_message(
    group: str, ours: frozenset[str], first: GroupLook, second: GroupLook, bootstrap: str
) -> str | None:
    """The warning for static members of ``group`` that look left behind (see StaleMemberWatch), or None."""
    others = {m for m in second.members if m not in ours and m in first.members}
    if not others:
        return None
    stranded = {
        member: [
            tp
            for tp in second.members[member]
            if tp in second.waiting and first.committed.get(tp) == second.committed.get(tp)
        ]
        for member in others
    }
    stranded = {member: tps for member, tps in stranded.items() if tps}
    rebalancing = "STABLE" not in first.state and "STABLE" not in second.state
    if not stranded and not rebalancing:
        return None
    named = sorted(stranded) if stranded else sorted(others)
    if stranded:
        held = "; ".join(f"{m}: " + ", ".join(f"{t}[{p}]" for t, p in sorted(stranded[m])) for m in named)
        gap = STALE_CHECK_AT_S[1] - STALE_CHECK_AT_S[0]
        what = f"hold partitions whose records wait with no commit for {gap:.0f}s ({held})"
    else:
        what = "are in it while it has been rebalancing since this App started, so no member gets partitions"
    ids = ", ".join(repr(m) for m in named)
    return (
        f"group {group!r} on the embedded broker: static member(s) {ids} that are not this process's {what}. "
        "The embedded broker never removes a static member that stopped without leaving the group (a killed "
        "process; kafkatx leaves it on a clean stop), so if those processes are gone, their partitions wait "
        'for them forever. Remove them: python -c "from kafkatx.client.membership import leave_group; '
        f'leave_group({bootstrap!r}, {group!r}, [{ids}])", or start each again under its instance id and stop '
        "it cleanly, or restart the embedded broker (its groups start empty; committed offsets are kept)"
    )


class _Topics(Protocol):
    @property
    def topics(self) -> tuple[str, ...]: ...


class RunningContainer(Protocol):
    """What the stale-member check needs of a container: its group, its static id, its topics."""

    @property
    def group_id(self) -> str: ...
    @property
    def consumer_config(self) -> Mapping[str, Any]: ...
    @property
    def spec(self) -> _Topics: ...


def watch_for_stale_members(
    admin_config: Mapping[str, Any],
    bootstrap_servers: str,
    cluster_id: str | None,
    containers: Sequence[RunningContainer],
) -> StaleMemberWatch | None:
    """Start a :class:`StaleMemberWatch` on the embedded broker for the static members' groups; None elsewhere."""
    if not is_embedded_broker(bootstrap_servers, cluster_id):
        return None
    ids: dict[str, set[str]] = {}
    topics: dict[str, set[str]] = {}
    for c in containers:
        instance = c.consumer_config.get("group.instance.id")
        if instance:
            ids.setdefault(c.group_id, set()).add(str(instance))
            topics.setdefault(c.group_id, set()).update(c.spec.topics)
    if not ids:
        return None
    groups = {g: (frozenset(ids[g]), tuple(sorted(topics[g]))) for g in ids}
    return StaleMemberWatch(admin_config, bootstrap_servers, groups).start()
