"""Static group members on the embedded broker: leaving on a clean stop, and finding the ones left behind.

librdkafka sends no LeaveGroup for a static member (``group.instance.id``)
when it closes, as KIP-345 intends: the broker keeps its partitions for a
restart under the same id, and Apache Kafka removes the member after
``session.timeout.ms`` if none comes. The embedded broker (noida-db 0.2.3)
never removes it: the member's partitions stay unconsumed, and a rebalance
waits for it (docs/BROKERS.md). It does honour KIP-345's LeaveGroup by
instance id (what Kafka's ``removeMembersFromConsumerGroup`` sends), which
librdkafka cannot send, so kafkatx sends it itself: a few bytes of the Kafka
protocol (LeaveGroup v3) to the local broker, on the embedded broker only.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

__all__ = ["LeaveGroupError", "leave_group"]

_LEAVE_GROUP = 13  # Kafka API key
_VERSION = 3  # the first with a list of members by group.instance.id (KIP-345), before flexible versions
_CLIENT_ID = "kafkatx"


class LeaveGroupError(RuntimeError):
    """The broker did not accept the LeaveGroup request (a Kafka error code, or no answer)."""


def _string(value: str) -> bytes:
    data = value.encode()
    return struct.pack(">h", len(data)) + data


def leave_group(bootstrap_servers: str, group_id: str, instance_ids: Sequence[str], timeout: float = 2.0) -> None:
    """Remove the static members ``instance_ids`` from ``group_id`` (LeaveGroup v3, by group.instance.id).

    For a single-node broker reachable without authentication (the embedded
    one): the request goes to the first bootstrap server, which is the
    group's coordinator there. Raises :class:`LeaveGroupError`.
    """
    if not instance_ids:
        return
    host, _, port = bootstrap_servers.split(",")[0].strip().rpartition(":")
    members = b"".join(_string("") + _string(instance) for instance in instance_ids)  # member id unknown: ""
    body = _string(group_id) + struct.pack(">i", len(instance_ids)) + members
    request = struct.pack(">hhi", _LEAVE_GROUP, _VERSION, 1) + _string(_CLIENT_ID) + body
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            size = struct.unpack(">i", _read(sock, 4))[0]
            answer = _read(sock, size)
    except (OSError, ValueError, struct.error) as exc:
        raise LeaveGroupError(f"LeaveGroup for {group_id!r} got no answer from {bootstrap_servers}: {exc}") from exc
    _correlation, _throttle, error = struct.unpack(">iih", answer[:10])
    if error:
        raise LeaveGroupError(f"LeaveGroup for {group_id!r} refused by {bootstrap_servers}: Kafka error {error}")


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("connection closed by the broker")
        data += chunk
    return data
