"""kafkatx's two tables in the user's database: consumed positions and the outbox.

``kafkatx_offsets`` holds, per group and input partition, the next offset
whose database work is not committed yet. ``kafkatx_outbox`` holds the Kafka
records each committed unit produced, keyed by the input range they came
from, until Kafka's own commit of that range is known. Both are written in
the handler's database transaction, so they commit or vanish with its rows.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from kafkatx.client.brokers import EMBEDDED_CLUSTER_ID
from kafkatx.client.identity import succeeds_shared_id
from kafkatx.client.offsets import TP
from kafkatx.database.backend import Backend
from kafkatx.outputs import PendingOutput

__all__ = ["Store", "StoredPosition", "OFFSETS_TABLE", "OUTBOX_TABLE", "reset_statements"]

OFFSETS_TABLE = "kafkatx_offsets"
OUTBOX_TABLE = "kafkatx_outbox"


#: Columns added to kafkatx_offsets after its first release: the Kafka log a position belongs to.
#: A table from an earlier version gets them on first use, empty: its rows adopt the cluster they are next used with.
_ADDED_COLUMNS = ("cluster_id", "topic_id")


def _shared(cluster_id: str | None) -> str | None:
    """The stored cluster id a row gives up for ``cluster_id``: noida-db's shared one, to the id kafkatx gave it."""
    return EMBEDDED_CLUSTER_ID if succeeds_shared_id(EMBEDDED_CLUSTER_ID, cluster_id) else None


class StoredPosition(NamedTuple):
    """A partition's row of kafkatx_offsets: its position, and the Kafka log it was written for (None: unknown)."""

    next_offset: int
    cluster_id: str | None
    topic_id: str | None


def reset_statements(group_id: str, topic: str) -> str:
    """The SQL that forgets a group's positions and stored outputs of one topic (to start it afresh)."""
    where = f"WHERE group_id = '{_quoted(group_id)}' AND topic = '{_quoted(topic)}'"
    return f"DELETE FROM {OFFSETS_TABLE} {where}; DELETE FROM {OUTBOX_TABLE} {where};"


def _quoted(value: str) -> str:
    return value.replace("'", "''")


def _ddl(dialect: str) -> list[str]:
    blob = {"postgresql": "BYTEA", "mysql": "LONGBLOB", "mariadb": "LONGBLOB"}.get(dialect, "BLOB")
    text = "VARCHAR(255)"
    return [
        f"CREATE TABLE IF NOT EXISTS {OFFSETS_TABLE} ("
        f" group_id {text} NOT NULL, topic {text} NOT NULL, kpartition INTEGER NOT NULL,"
        f" next_offset BIGINT NOT NULL, cluster_id {text}, topic_id {text},"
        " PRIMARY KEY (group_id, topic, kpartition))",
        f"CREATE TABLE IF NOT EXISTS {OUTBOX_TABLE} ("
        f" group_id {text} NOT NULL, topic {text} NOT NULL, kpartition INTEGER NOT NULL,"
        f" next_offset BIGINT NOT NULL, record_count INTEGER NOT NULL, records {blob} NOT NULL,"
        " PRIMARY KEY (group_id, topic, kpartition, next_offset))",
    ]


# One outbox row per unit and input partition holds all its records: one INSERT per commit, whatever the
# number of outputs. Per record: lengths of topic, key, value, headers (-1: None) and the partition (-1: None),
# then the bytes. Headers as JSON ([name, base64 value or null]), rare enough not to need better.
_FORMAT = b"\x01"
_HEAD = struct.Struct(">Hiiii")


def encode_records(outputs: Sequence[PendingOutput]) -> bytes:
    parts: list[bytes] = [_FORMAT]
    pack = _HEAD.pack
    for topic_name, value, key, out_headers, partition in outputs:
        topic = topic_name.encode()
        headers = _headers_out(out_headers)
        hdr = headers.encode() if headers is not None else None
        parts.append(
            pack(
                len(topic),
                -1 if key is None else len(key),
                -1 if value is None else len(value),
                -1 if hdr is None else len(hdr),
                -1 if partition is None else partition,
            )
        )
        parts.append(topic)
        if key:
            parts.append(key)
        if value:
            parts.append(value)
        if hdr:
            parts.append(hdr)
    return b"".join(parts)


def decode_records(data: bytes) -> list[PendingOutput]:
    if data[:1] != _FORMAT:
        raise ValueError(f"unknown kafkatx outbox format {data[:1]!r}")
    view, pos, size, unpack = memoryview(data), 1, _HEAD.size, _HEAD.unpack_from
    outputs = []
    while pos < len(data):
        lt, lk, lv, lh, partition = unpack(view, pos)
        pos += size
        topic = bytes(view[pos : pos + lt]).decode()
        pos += lt
        key = None if lk < 0 else bytes(view[pos : pos + lk])
        pos += max(lk, 0)
        value = None if lv < 0 else bytes(view[pos : pos + lv])
        pos += max(lv, 0)
        headers = None if lh < 0 else _headers_in(bytes(view[pos : pos + lh]).decode())
        pos += max(lh, 0)
        outputs.append((topic, value, key, headers, None if partition < 0 else partition))
    return outputs


def _headers_out(headers: list[tuple[str, bytes]] | None) -> str | None:
    if headers is None:
        return None
    return json.dumps([[k, None if v is None else base64.b64encode(v).decode("ascii")] for k, v in headers])


def _headers_in(text: str) -> list[tuple[str, bytes]]:
    return [(k, base64.b64decode(v) if v is not None else None) for k, v in json.loads(text)]  # type: ignore[misc]


class Store:
    """The statements kafkatx runs on its tables (portable SQL: SQLite, PostgreSQL, MySQL)."""

    def __init__(self, backend: Backend, group_id: str) -> None:
        self.backend, self.group_id = backend, group_id
        # One statement that creates the row if needed, locks it until commit and returns it
        # (SQLite 3.35+ and PostgreSQL; elsewhere three statements do the same).
        self._returning = backend.dialect in ("sqlite", "postgresql")

    def create_tables(self, conn: Any) -> list[str]:
        """Create kafkatx's tables, or add what an earlier version's lack; the names of the columns added."""
        for statement in _ddl(self.backend.dialect):
            self.backend.execute(conn, statement)
        return self.add_missing_columns(conn)

    def add_missing_columns(self, conn: Any) -> list[str]:
        """Add the columns a table created by an earlier kafkatx lacks; the names added."""
        present = {name.lower() for name in self.backend.columns(conn, OFFSETS_TABLE)}
        missing = [name for name in _ADDED_COLUMNS if name not in present]
        for name in missing:
            self.backend.execute(conn, f"ALTER TABLE {OFFSETS_TABLE} ADD COLUMN {name} VARCHAR(255)")
        return missing

    def lock_position(self, conn: Any, tp: TP) -> int:
        """The partition's next offset without committed database work, its row locked until commit."""
        return self.lock(conn, tp, None, None).next_offset

    def lock(self, conn: Any, tp: TP, cluster_id: str | None, topic_id: str | None) -> StoredPosition:
        """The partition's row, locked until commit; created (for this cluster and topic id) if there is none.

        The lock makes a second owner of the partition (a zombie that has not
        noticed it was replaced) wait, then see what the first committed.
        """
        b = self.backend
        params = {"g": self.group_id, "t": tp[0], "p": tp[1], "c": cluster_id, "i": topic_id}
        columns = "next_offset, cluster_id, topic_id"
        insert = (
            f"INSERT INTO {OFFSETS_TABLE} (group_id, topic, kpartition, next_offset, cluster_id, topic_id) "
            "VALUES (:g, :t, :p, -1, :c, :i)"
        )
        if self._returning:
            rows = b.execute(
                conn,
                f"{insert} ON CONFLICT (group_id, topic, kpartition) DO UPDATE SET next_offset = "
                f"{OFFSETS_TABLE}.next_offset RETURNING {columns}",
                params,
            )
            return _position(rows[0])
        # Lock first, read second: a read before the lock would return the position as it was before the
        # commit of the owner the lock waited for (and, under REPEATABLE READ, would fix the snapshot).
        b.execute(
            conn,
            f"UPDATE {OFFSETS_TABLE} SET next_offset = next_offset "
            "WHERE group_id = :g AND topic = :t AND kpartition = :p",
            params,
        )
        rows = b.execute(
            conn,
            f"SELECT {columns} FROM {OFFSETS_TABLE} WHERE group_id = :g AND topic = :t AND kpartition = :p",
            params,
        )
        if not rows:
            b.execute(conn, insert, params)
            return StoredPosition(-1, cluster_id, topic_id)
        return _position(rows[0])

    def adopt(self, conn: Any, tp: TP, cluster_id: str | None, topic_id: str | None) -> None:
        """Tie a row written without its Kafka log (an earlier kafkatx, a broker without topic ids) to this one.

        A row of noida-db's shared cluster id takes the id kafkatx gave that
        broker (kafkatx.client.identity.succeeds_shared_id).
        """
        self.backend.execute(
            conn,
            f"UPDATE {OFFSETS_TABLE} SET cluster_id = COALESCE(NULLIF(cluster_id, :shared), :c), "
            "topic_id = COALESCE(topic_id, :i) WHERE group_id = :g AND topic = :t AND kpartition = :p",
            {"g": self.group_id, "t": tp[0], "p": tp[1], "c": cluster_id, "i": topic_id, "shared": _shared(cluster_id)},
        )

    def advance(self, conn: Any, tp: TP, next_offset: int, outputs: Sequence[PendingOutput]) -> None:
        """Record that the input up to ``next_offset`` is done, with the Kafka records it produced."""
        b, g = self.backend, self.group_id
        b.execute(
            conn,
            f"UPDATE {OFFSETS_TABLE} SET next_offset = :n WHERE group_id = :g AND topic = :t AND kpartition = :p "
            "AND next_offset < :n",
            {"g": g, "t": tp[0], "p": tp[1], "n": next_offset},
        )
        if outputs:
            b.execute(
                conn,
                f"INSERT INTO {OUTBOX_TABLE} (group_id, topic, kpartition, next_offset, record_count, records) "
                "VALUES (:g, :t, :p, :n, :c, :r)",
                {"g": g, "t": tp[0], "p": tp[1], "n": next_offset, "c": len(outputs), "r": encode_records(outputs)},
            )

    def forget_before(self, conn: Any, tp: TP, committed: int) -> None:
        """Drop outbox rows of input Kafka has committed (up to ``committed``): never needed again."""
        self.backend.execute(
            conn,
            f"DELETE FROM {OUTBOX_TABLE} WHERE group_id = :g AND topic = :t AND kpartition = :p AND next_offset <= :c",
            {"g": self.group_id, "t": tp[0], "p": tp[1], "c": committed},
        )

    def outputs_between(self, conn: Any, tp: TP, start: int, end: int) -> list[PendingOutput]:
        """The records produced for the input in [``start``, ``end``), in their original order."""
        rows = self.backend.execute(
            conn,
            f"SELECT records FROM {OUTBOX_TABLE} "
            "WHERE group_id = :g AND topic = :t AND kpartition = :p AND next_offset > :s AND next_offset <= :e "
            "ORDER BY next_offset",
            {"g": self.group_id, "t": tp[0], "p": tp[1], "s": start, "e": end},
        )
        return [out for (data,) in rows for out in decode_records(bytes(data))]


def _position(row: tuple[Any, ...]) -> StoredPosition:
    return StoredPosition(int(row[0]), row[1], row[2])
