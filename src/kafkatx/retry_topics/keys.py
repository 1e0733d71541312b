"""``ordering="key"`` with retry topics: which keys have a record in retry, and where a record of theirs follows.

A record whose key (on its input partition) has an earlier record in retry
does not run: it **follows**, written behind that key's first record in retry
(the *head*: the earliest input offset), in the head's retry topic, due when
the head is, with its attempt unchanged. Read back, a record runs only if it
is its key's head by then; otherwise it follows again. So each follower moves
at most once per hop of the head, never overtakes it, and once the head is
done (handled, or dead-lettered after its last attempt) the followers run in
input order. A record without a key has no key order: it never follows.

What is in retry is exactly what the retry partitions hold past their
committed offsets, so the set is kept as the transactions commit, never ahead
of them:

- :meth:`RetryKeys.began` opens a journal for a transaction (one per
  transactional producer: with ``fencing="partition"`` another partition's
  transaction may be open meanwhile); the hops written in it are noted there
  (:meth:`RetryKeys.wrote`) and the retry records it consumed too
  (:meth:`RetryKeys.consumed`), so that the records after them in the same
  transaction see both;
- :meth:`RetryKeys.committed` applies what committed: the retry records whose
  offsets the commit covers leave, then the hops written join; an aborted
  transaction's journal is dropped by its producer's next :meth:`began`;
- :meth:`RetryKeys.rebuilt` sets an input partition's keys from a read of its
  retry partitions from their committed offsets to the end (at assignment:
  never from memory), :meth:`RetryKeys.forget` drops them at revocation.

Pure: no I/O, one container's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kafkatx.client.offsets import TP
from kafkatx.record import ConsumedMessage, Record

__all__ = ["Place", "RetryKeys"]

#: One key's records in retry: input offset -> where it waits.
Entries = dict[int, "Place"]
#: What a retry record consumed is a hop of: ``(input TP, key, input offset)``; None if it is no hop.
HopOf = Callable[[ConsumedMessage], "tuple[TP, bytes | None, int] | None"]


@dataclass(frozen=True, slots=True)
class Place:
    """Where a record in retry waits: its retry topic, and when it is due (epoch ms)."""

    topic: str
    due_ms: int


class _Journal:
    """One open transaction's changes: the hops it wrote, and its own view of the keys it touched."""

    __slots__ = ("wrote", "overlay")

    def __init__(self) -> None:
        self.wrote: list[tuple[TP, bytes | None, int, Place]] = []
        #: (input TP, key) -> its entries as this transaction sees them (copied on first change).
        self.overlay: dict[tuple[TP, bytes], Entries] = {}


class RetryKeys:
    """The keys in retry of the input partitions a container owns (see the module)."""

    __slots__ = ("_keys", "_journals", "_current", "_origin", "_count", "_told", "_on_count")

    def __init__(self, origin: Mapping[str, str], on_count: Callable[[int], None] | None = None) -> None:
        """``origin``: retry topic -> its input topic; ``on_count`` is told how many records are in retry whenever
        that changes (committed, rebuilt, forgotten)."""
        #: input TP -> key -> its records in retry; keyless records under None (counted, never followed).
        self._keys: dict[TP, dict[bytes | None, Entries]] = {}
        self._journals: dict[int, _Journal] = {}
        self._current: _Journal | None = None
        self._origin = dict(origin)
        self._count = self._told = 0
        self._on_count = on_count

    # -- what a record does --------------------------------------------------------------
    def ahead(self, view: Record) -> Place | None:
        """Where ``view`` (an input record, as its handler sees it) must follow its key's head; None: it runs."""
        key = view.raw_key
        if key is None or (not self._keys and not self._overlay_used()):
            return None
        entries = self._entries((view.topic, view.partition), key)
        if not entries:
            return None
        head = min(entries)
        return entries[head] if head < view.offset else None

    def wrote(self, view: Record, place: Place) -> None:
        """A hop of ``view`` to ``place`` was produced in the open transaction."""
        key = view.raw_key
        journal = self._current
        if journal is None:
            return
        tp = (view.topic, view.partition)
        journal.wrote.append((tp, key, view.offset, place))
        if key is not None:  # a keyless record is counted, never followed
            self._own(journal, tp, key)[view.offset] = place

    def consumed(self, view: Record) -> None:
        """``view``, read from a retry topic, is being handled in the open transaction: it is no longer in retry
        for the records after it (it hops again through :meth:`wrote` if it fails)."""
        key = view.raw_key
        journal = self._current
        if key is None or journal is None:
            return
        self._own(journal, (view.topic, view.partition), key).pop(view.offset, None)

    # -- the transactions ----------------------------------------------------------------
    def began(self, txn: object) -> None:
        """A transaction began on producer ``txn``: a fresh journal (what an aborted one noted is dropped)."""
        self._current = self._journals[id(txn)] = _Journal()

    def committed(
        self, txn: object, offsets: Mapping[TP, int], consumed: Iterable[ConsumedMessage], hop_of: HopOf
    ) -> None:
        """Producer ``txn`` committed ``offsets``: the retry records of ``consumed`` below them leave (read from
        their hop headers by ``hop_of``), then the hops it wrote join."""
        journal = self._journals.pop(id(txn), None)
        if self._current is journal:
            self._current = None
        origin = self._origin
        for msg in consumed:
            topic = msg.topic()
            if topic in origin and msg.offset() < offsets.get((topic, msg.partition()), -1):
                found = hop_of(msg)
                if found is not None:
                    self._drop(*found)
        if journal is not None:
            for tp, key, offset, place in journal.wrote:
                entries = self._keys.setdefault(tp, {}).setdefault(key, {})
                self._count += offset not in entries
                entries[offset] = place
        self._tell()

    def rebuilt(self, tp: TP, in_retry: Iterable[tuple[bytes | None, int, Place]]) -> None:
        """Input partition ``tp``'s keys, from its retry partitions read from the committed offsets to the end:
        ``(key, input offset, place)`` of each hop found, in the order read."""
        keys: dict[bytes | None, Entries] = {}
        for key, offset, place in in_retry:
            keys.setdefault(key, {})[offset] = place
        self._count -= self.in_retry(tp)
        if keys:
            self._keys[tp] = keys
        else:
            self._keys.pop(tp, None)
        self._count += self.in_retry(tp)
        self._tell()

    def forget(self, tps: Iterable[TP]) -> None:
        """Input partitions revoked or lost: their keys go (their next owner rebuilds them)."""
        for tp in tps:
            self._count -= self.in_retry(tp)
            self._keys.pop(tp, None)
        self._tell()

    # -- what it holds ---------------------------------------------------------------------
    def in_retry(self, tp: TP | None = None) -> int:
        """How many records are in retry (committed), of ``tp`` or of every input partition."""
        if tp is None:
            return self._count
        return sum(len(entries) for entries in self._keys.get(tp, {}).values())

    def keys_in_retry(self, tp: TP) -> dict[bytes | None, list[int]]:
        """``tp``'s keys in retry (committed), each with its records' input offsets in order."""
        return {key: sorted(entries) for key, entries in self._keys.get(tp, {}).items()}

    # -- inside -----------------------------------------------------------------------------
    def _tell(self) -> None:
        if self._count != self._told and self._on_count is not None:
            self._told = self._count
            self._on_count(self._count)

    def _overlay_used(self) -> bool:
        journal = self._current
        return journal is not None and bool(journal.overlay)

    def _entries(self, tp: TP, key: bytes) -> Entries | None:
        journal = self._current
        if journal is not None:
            mine = journal.overlay.get((tp, key))
            if mine is not None:
                return mine
        return self._keys.get(tp, {}).get(key)

    def _own(self, journal: _Journal, tp: TP, key: bytes) -> Entries:
        mine = journal.overlay.get((tp, key))
        if mine is None:
            mine = journal.overlay[(tp, key)] = dict(self._keys.get(tp, {}).get(key, {}))
        return mine

    def _drop(self, tp: TP, key: bytes | None, offset: int) -> None:
        keys = self._keys.get(tp)
        if keys is None:
            return
        entries = keys.get(key)
        if entries is None:
            return
        if entries.pop(offset, None) is not None:
            self._count -= 1
        if not entries:
            del keys[key]
            if not keys:
                del self._keys[tp]
