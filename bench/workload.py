"""The benchmark's workload, shared by the driver (run.py) and the runs (workers.py).

What the input records are (keys, values, which ones are poison) and what each
record becomes in every output shape. bench/run.py preloads the input and
verifies the outputs from these; bench/workers.py's handlers and hand-written
loops produce them. Standard library only, so that importing it adds nothing
to a run's memory.
"""

from __future__ import annotations

import json
from typing import Any

POISON_OFFSET = 50  # see is_poison()
HEADERS = {"source": b"bench"}

#: shape -> (what the kafkatx handler does, how many records each input record becomes)
SHAPES: dict[str, tuple[str, int]] = {
    "bytes": ("return record.value.upper()", 1),
    "keyed": ("return (record.key, record.value.upper())", 1),
    "output": ("return Output(value.upper(), key=key, headers={'source': b'bench'})", 1),
    "generator": ("yield (key, value.upper()); yield (key, value)", 2),
    "send": ("send(out, value.upper(), key); return None", 1),
    "serializer": ("return {'v': value.decode().upper(), 'o': offset}, serializer=json", 1),
    # the bytes shape's output, computed with numpy (per record, or over a batch listener's values at once)
    "numpy": ("return numpy_upper(record.value)", 1),
}


def is_poison(i: int, poison_every: int, partitions: int) -> bool:
    """Record i (partition i % P, offset i // P) is poison once per ``poison_every`` offsets of
    each partition, at a different offset in each partition, so poison is spread evenly
    over partitions and time (``i % 100 == 50`` would put it all in 2 of 8 partitions)."""
    if not poison_every:
        return False
    offset, partition = divmod(i, partitions)
    return (offset + 13 * partition) % poison_every == POISON_OFFSET


def make_key(i: int) -> bytes:
    """Record i's key (every input record has one: keeping it is what most transforms do)."""
    return b"key-%09d" % i


def make_value(i: int, size: int, poison_every: int, partitions: int) -> bytes:
    """``000000042:record:abcdefghij...`` padded to ``size`` bytes; lower case so upper() changes it."""
    kind = "poison" if is_poison(i, poison_every, partitions) else "record"
    head = f"{i:09d}:{kind}:"
    filler = "abcdefghijklmnopqrstuvwxyz" * (size // 26 + 1)
    return (head + filler)[: max(size, len(head))].encode()


def dumps_json(obj: Any) -> bytes:
    """The serializer shape's serializer (and its twin's encoding)."""
    return json.dumps(obj).encode()


def expected_outputs(shape: str, key: bytes | None, value: bytes, offset: int) -> list[tuple[bytes | None, bytes, Any]]:
    """(key, value, headers) of the records one input record becomes, as read back."""
    if shape in ("bytes", "numpy"):
        return [(None, value.upper(), None)]
    if shape in ("keyed", "send"):
        return [(key, value.upper(), None)]
    if shape == "output":
        return [(key, value.upper(), list(HEADERS.items()))]
    if shape == "generator":
        return [(key, value.upper(), None), (key, value, None)]
    if shape == "serializer":
        return [(None, dumps_json({"v": value.decode().upper(), "o": offset}), None)]
    raise SystemExit(f"unknown shape {shape!r}")
