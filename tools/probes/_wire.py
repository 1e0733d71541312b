"""A minimal Kafka wire client for probes: send a Fetch, decode every field.

Only what the probes need: ApiVersions v0 and Fetch v4/v5 (non-flexible
versions, so no tagged fields), with record batches decoded down to base
offset, producer id and control type. It lets a probe see exactly what a
broker answers (last stable offset, aborted-transactions list, batches)
without a client library interpreting it first.
"""

from __future__ import annotations

import io
import socket
import struct
from dataclasses import dataclass, field

FETCH, API_VERSIONS = 1, 18
READ_UNCOMMITTED, READ_COMMITTED = 0, 1


@dataclass(frozen=True)
class Batch:
    base_offset: int
    last_offset: int
    producer_id: int
    transactional: bool
    kind: str  # "data", "COMMIT" or "ABORT"
    records: int


@dataclass(frozen=True)
class PartitionFetch:
    partition: int
    error_code: int
    high_watermark: int
    last_stable_offset: int
    log_start_offset: int | None
    aborted_transactions: list[tuple[int, int]] | None  # (producer_id, first_offset)
    batches: list[Batch] = field(default_factory=list)


class Connection:
    """One blocking TCP connection to a broker."""

    def __init__(self, host: str, port: int, client_id: str = "kafkatx-probe") -> None:
        self._sock = socket.create_connection((host, port), timeout=10)
        self._client_id = client_id.encode()
        self._correlation = 0

    def close(self) -> None:
        self._sock.close()

    def request(self, api_key: int, version: int, body: bytes) -> io.BytesIO:
        self._correlation += 1
        header = struct.pack(">hhih", api_key, version, self._correlation, len(self._client_id)) + self._client_id
        message = header + body
        self._sock.sendall(struct.pack(">i", len(message)) + message)
        (size,) = struct.unpack(">i", self._read(4))
        data = self._read(size)
        (correlation,) = struct.unpack(">i", data[:4])
        assert correlation == self._correlation, (correlation, self._correlation)
        return io.BytesIO(data[4:])

    def _read(self, n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = self._sock.recv(n - len(chunks))
            if not chunk:
                raise ConnectionError("broker closed the connection")
            chunks += chunk
        return bytes(chunks)


def _read(f: io.BytesIO, fmt: str) -> tuple[int, ...]:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def api_versions(conn: Connection) -> dict[int, tuple[int, int]]:
    f = conn.request(API_VERSIONS, 0, b"")
    _read(f, ">h")
    (n,) = _read(f, ">i")
    return {key: (lo, hi) for key, lo, hi in (_read(f, ">hhh") for _ in range(n))}


def fetch(
    conn: Connection,
    topic: str,
    partition: int,
    offset: int,
    *,
    isolation: int = READ_COMMITTED,
    max_bytes: int = 1 << 20,
    version: int = 5,
) -> PartitionFetch:
    """One Fetch for one partition, from ``offset``, with max_wait 0."""
    if version not in (4, 5):
        raise ValueError("only Fetch v4 and v5 are implemented")
    body = struct.pack(">iiiib", -1, 0, 0, max_bytes, isolation)
    body += struct.pack(">i", 1) + _string(topic) + struct.pack(">i", 1) + struct.pack(">iq", partition, offset)
    if version >= 5:
        body += struct.pack(">q", -1)  # log_start_offset (followers only)
    body += struct.pack(">i", max_bytes)
    f = conn.request(FETCH, version, body)
    _read(f, ">i")  # throttle_time_ms
    (topics,) = _read(f, ">i")
    assert topics == 1
    (name_len,) = _read(f, ">h")
    f.read(name_len)
    (parts,) = _read(f, ">i")
    assert parts == 1
    p, err, hw, lso = _read(f, ">ihqq")
    log_start = _read(f, ">q")[0] if version >= 5 else None
    (n_aborted,) = _read(f, ">i")
    aborted = [(int(pid), int(first)) for pid, first in (_read(f, ">qq") for _ in range(max(n_aborted, 0)))]
    (records_len,) = _read(f, ">i")
    records = f.read(records_len) if records_len > 0 else b""
    return PartitionFetch(p, err, hw, lso, log_start, aborted if n_aborted >= 0 else None, decode_batches(records))


def _varint(f: io.BytesIO) -> int:
    shift = value = 0
    while True:
        byte = f.read(1)[0]
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (value >> 1) ^ -(value & 1)


def decode_batches(data: bytes) -> list[Batch]:
    """Record batches (magic 2) in a fetched record set; a trailing partial batch is dropped."""
    f = io.BytesIO(data)
    out: list[Batch] = []
    while True:
        head = f.read(12)
        if len(head) < 12:
            return out
        base, length = struct.unpack(">qi", head)
        body = f.read(length)
        if len(body) < length:
            return out
        _epoch, _magic, _crc, attrs, last_delta, _ft, _mt, pid, _pe, _seq, count = struct.unpack(
            ">ibIhiqqqhii", body[:49]
        )
        kind = "data"
        if attrs & 0x20:  # control batch: the first record's key is (version int16, type int16)
            r = io.BytesIO(body[49:])
            _varint(r)  # record length
            r.read(1)  # attributes
            _varint(r)  # timestamp delta
            _varint(r)  # offset delta
            key = r.read(_varint(r))
            kind = {0: "ABORT", 1: "COMMIT"}.get(struct.unpack(">hh", key)[1], "CONTROL?")
        out.append(Batch(base, base + last_delta, pid, bool(attrs & 0x10), kind, count))


def kafka_aborted_list(full_log: list[Batch], fetch_offset: int, upper_bound: int) -> list[tuple[int, int]]:
    """What Apache Kafka would list for a read_committed fetch of [fetch_offset, upper_bound).

    Kafka's transaction index keeps (producer_id, first_offset, last_offset)
    per aborted transaction, last_offset being its ABORT marker, and a fetch
    lists those that overlap the fetched range: last_offset >= fetch_offset
    and first_offset < upper_bound. ``full_log`` is a read_uncommitted read
    of the whole partition (it has the aborted data batches and markers).
    """
    first_open: dict[int, int] = {}
    out: list[tuple[int, int]] = []
    for b in full_log:
        if b.kind == "data" and b.transactional:
            first_open.setdefault(b.producer_id, b.base_offset)
        elif b.kind in ("COMMIT", "ABORT"):
            first = first_open.pop(b.producer_id, None)
            if b.kind == "ABORT" and first is not None and b.base_offset >= fetch_offset and first < upper_bound:
                out.append((b.producer_id, first))
    return out
