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
from collections.abc import Sequence
from typing import Any

from kafkatx.database._backend import Backend
from kafkatx.outputs import PendingOutput

__all__ = ["Store", "OFFSETS_TABLE", "OUTBOX_TABLE"]

OFFSETS_TABLE = "kafkatx_offsets"
OUTBOX_TABLE = "kafkatx_outbox"

TP = tuple[str, int]


def _ddl(dialect: str) -> list[str]:
    blob = {"postgresql": "BYTEA", "mysql": "LONGBLOB", "mariadb": "LONGBLOB"}.get(dialect, "BLOB")
    text = "VARCHAR(255)"
    return [
        f"CREATE TABLE IF NOT EXISTS {OFFSETS_TABLE} ("
        f" group_id {text} NOT NULL, topic {text} NOT NULL, kpartition INTEGER NOT NULL,"
        " next_offset BIGINT NOT NULL,"
        " PRIMARY KEY (group_id, topic, kpartition))",
        f"CREATE TABLE IF NOT EXISTS {OUTBOX_TABLE} ("
        f" group_id {text} NOT NULL, topic {text} NOT NULL, kpartition INTEGER NOT NULL,"
        " next_offset BIGINT NOT NULL, seq INTEGER NOT NULL,"
        f" out_topic {text} NOT NULL, out_partition INTEGER, out_key {blob}, out_value {blob}, out_headers TEXT,"
        " PRIMARY KEY (group_id, topic, kpartition, next_offset, seq))",
    ]


def _headers_out(headers: list[tuple[str, bytes]] | None) -> str | None:
    if not headers:
        return None
    return json.dumps([[k, None if v is None else base64.b64encode(v).decode("ascii")] for k, v in headers])


def _headers_in(text: str | None) -> list[tuple[str, bytes]] | None:
    if not text:
        return None
    return [(k, base64.b64decode(v) if v is not None else None) for k, v in json.loads(text)]  # type: ignore[misc]


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


class Store:
    """The statements kafkatx runs on its tables (portable SQL: SQLite, PostgreSQL, MySQL)."""

    def __init__(self, backend: Backend, group_id: str) -> None:
        self.backend, self.group_id = backend, group_id
        # One statement that creates the row if needed, locks it until commit and returns it
        # (SQLite 3.35+ and PostgreSQL; elsewhere three statements do the same).
        self._returning = backend.dialect in ("sqlite", "postgresql")

    def create_tables(self, conn: Any) -> None:
        for statement in _ddl(self.backend.dialect):
            self.backend.execute(conn, statement)

    def lock_position(self, conn: Any, tp: TP) -> int:
        """The partition's next offset without committed database work, its row locked until commit.

        The lock makes a second owner of the partition (a zombie that has not
        noticed it was replaced) wait, then see what the first committed.
        """
        b = self.backend
        params = {"g": self.group_id, "t": tp[0], "p": tp[1]}
        if self._returning:
            rows = b.execute(
                conn,
                f"INSERT INTO {OFFSETS_TABLE} (group_id, topic, kpartition, next_offset) VALUES (:g, :t, :p, -1) "
                "ON CONFLICT (group_id, topic, kpartition) DO UPDATE SET next_offset = "
                f"{OFFSETS_TABLE}.next_offset RETURNING next_offset",
                params,
            )
            return int(rows[0][0])
        rows = b.execute(
            conn,
            f"SELECT next_offset FROM {OFFSETS_TABLE} WHERE group_id = :g AND topic = :t AND kpartition = :p",
            params,
        )
        if not rows:
            b.execute(conn, f"INSERT INTO {OFFSETS_TABLE} (group_id, topic, kpartition, next_offset) "
                            "VALUES (:g, :t, :p, -1)", params)  # fmt: skip
            return -1
        b.execute(conn, f"UPDATE {OFFSETS_TABLE} SET next_offset = next_offset "
                        "WHERE group_id = :g AND topic = :t AND kpartition = :p", params)  # fmt: skip
        return int(rows[0][0])

    def advance(self, conn: Any, tp: TP, next_offset: int, outputs: Sequence[PendingOutput]) -> None:
        """Record that the input up to ``next_offset`` is done, with the Kafka records it produced."""
        b, g = self.backend, self.group_id
        b.execute(
            conn,
            f"UPDATE {OFFSETS_TABLE} SET next_offset = :n WHERE group_id = :g AND topic = :t AND kpartition = :p "
            "AND next_offset < :n",
            {"g": g, "t": tp[0], "p": tp[1], "n": next_offset},
        )
        b.executemany(
            conn,
            f"INSERT INTO {OUTBOX_TABLE} (group_id, topic, kpartition, next_offset, seq, out_topic, out_partition, "
            "out_key, out_value, out_headers) VALUES (:g, :t, :p, :n, :s, :ot, :op, :k, :v, :h)",
            [
                {"g": g, "t": tp[0], "p": tp[1], "n": next_offset, "s": seq, "ot": out.topic, "op": out.partition,
                 "k": out.key, "v": out.value, "h": _headers_out(out.headers)}  # fmt: skip
                for seq, out in enumerate(outputs)
            ],
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
            f"SELECT out_topic, out_value, out_key, out_headers, out_partition FROM {OUTBOX_TABLE} "
            "WHERE group_id = :g AND topic = :t AND kpartition = :p AND next_offset > :s AND next_offset <= :e "
            "ORDER BY next_offset, seq",
            {"g": self.group_id, "t": tp[0], "p": tp[1], "s": start, "e": end},
        )
        return [PendingOutput(r[0], _bytes(r[1]), _bytes(r[2]), _headers_in(r[3]), r[4]) for r in rows]
