"""The records in retry of a container's partitions and, with ``ordering="key"``, where a record of their key follows.

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

Most records have no key in retry, so the gate asks one question of each
first: is its key in :attr:`RetryKeys.maybe`, a count per key of the
(input partition, key) pairs with records in retry, committed or written by
an open transaction (a superset of what :meth:`RetryKeys.ahead` can find)?
Only a key found there is looked up in full.

With ``ordering="none"`` the same book is kept without the key gate: it counts
the records in retry and their earliest due time (what the metrics publish),
and notes the retry records whose handler returned (:meth:`RetryKeys.handled`),
told once their transaction committed.

Pure: no I/O, one container's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kafkatx.client.offsets import TP
from kafkatx.record import ConsumedMessage, Record
from kafkatx.retry_topics.due import DueTimes

__all__ = ["Place", "RetryKeys"]

#: One key's records in retry: input offset -> where it waits.
Entries = dict[int, "Place"]
#: What a retry record consumed is a hop of: ``(input TP, key, input offset)``; None if it is no hop.
HopOf = Callable[[ConsumedMessage], "tuple[TP, bytes | None, int] | None"]


def _retry_records(
    consumed: Sequence[ConsumedMessage], origin: Mapping[str, str], offsets: Mapping[TP, int]
) -> list[ConsumedMessage]:
    """The records of ``consumed`` from retry topics; none when the commit's ``offsets`` hold no retry partition
    (then it committed no retry record)."""
    if not any(tp[0] in origin for tp in offsets):
        return []
    return [msg for msg in consumed if msg.topic() in origin]


@dataclass(frozen=True, slots=True)
class Place:
    """Where a record in retry waits: its retry topic, and when it is due (epoch ms)."""

    topic: str
    due_ms: int


class _Journal:
    """One open transaction's changes: the hops it wrote, and its own view of the keys it touched."""

    __slots__ = ("wrote", "overlay", "handled", "marked")

    def __init__(self) -> None:
        #: ``(input TP, key, input offset, place, the record consumed)``: the hop counts once the transaction
        #: commits that record (None: it counts with the commit).
        self.wrote: list[tuple[TP, bytes | None, int, Place, tuple[TP, int] | None]] = []
        #: (input TP, key) -> its entries as this transaction sees them (copied on first change).
        self.overlay: dict[tuple[TP, bytes], Entries] = {}
        #: (input TP, input offset) -> the input view of a retry record whose handler returned in it.
        self.handled: dict[tuple[TP, int], Record] = {}
        #: The keys this journal counted in :attr:`RetryKeys.maybe` (one per hop of a keyed record it wrote).
        self.marked: list[bytes] = []


class RetryKeys:
    """The keys in retry of the input partitions a container owns (see the module)."""

    __slots__ = (
        "_keys",
        "_journals",
        "_current",
        "_origin",
        "_count",
        "_told",
        "_on_count",
        "_due",
        "key_order",
        "maybe",
    )

    def __init__(
        self,
        origin: Mapping[str, str],
        on_count: Callable[[int, int | None], None] | None = None,
        *,
        key_order: bool = True,
    ) -> None:
        """``origin``: retry topic -> its input topic; ``on_count`` is told how many records are in retry and the
        earliest due time among them (epoch ms, None when none) whenever either changes (committed, rebuilt,
        forgotten). ``key_order`` False: counted only, no record follows (:meth:`ahead` is not asked)."""
        #: input TP -> key -> its records in retry; keyless records under None (counted, never followed).
        self._keys: dict[TP, dict[bytes | None, Entries]] = {}
        self._journals: dict[int, _Journal] = {}
        self._current: _Journal | None = None
        self._origin = dict(origin)
        self._count = 0
        self._told: tuple[int, int | None] = (0, None)
        self._on_count = on_count
        self._due = DueTimes()
        self.key_order = key_order
        #: key -> how many (input partition, key) pairs have records in retry (committed) plus how many hops of it
        #: open transactions wrote: a key absent here has nothing in retry, and the gate looks no further. The
        #: same dict for the book's life (the gate holds it).
        self.maybe: dict[bytes, int] = {}

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

    def wrote(self, view: Record, place: Place, consumed: tuple[TP, int] | None = None) -> None:
        """A hop of ``view`` to ``place`` was produced in the open transaction, for the record ``consumed`` (its
        partition and offset as consumed: an input or a retry record). With ``consumed``, the hop joins the book
        only if the commit covers that record: handled concurrently, a record past a failed one may have been
        gated (and booked) before the failure cut the transaction short, its work discarded with it."""
        key = view.raw_key
        journal = self._current
        if journal is None:
            return
        tp = (view.topic, view.partition)
        journal.wrote.append((tp, key, view.offset, place, consumed))
        journal.handled.pop((tp, view.offset), None)  # it failed after its handler returned (its outputs did)
        if key is not None and self.key_order:  # a keyless record is counted, never followed
            self._own(journal, tp, key)[view.offset] = place
            journal.marked.append(key)
            _mark(self.maybe, key)

    def handled(self, view: Record) -> None:
        """``view``, read from a retry topic, was handled (its handler returned) in the open transaction."""
        journal = self._current
        if journal is not None:
            journal.handled[((view.topic, view.partition), view.offset)] = view

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
        dropped = self._journals.get(id(txn))
        if dropped is not None:
            self._unmark(dropped)
        self._current = self._journals[id(txn)] = _Journal()

    def committed(
        self, txn: object, offsets: Mapping[TP, int], consumed: Sequence[ConsumedMessage], hop_of: HopOf
    ) -> list[Record]:
        """Producer ``txn`` committed ``offsets``: the retry records of ``consumed`` below them leave (read from
        their hop headers by ``hop_of``), then the hops it wrote join. ``consumed``: the records the transaction
        may have taken out of retry (the container's: those its retry feed delivered below ``offsets``). Returns the input views of the retry
        records it committed whose handler returned (and that did not hop again): the retries handled."""
        journal = self._journals.pop(id(txn), None)
        if self._current is journal:
            self._current = None
        origin = self._origin
        handled: list[Record] = []
        for msg in _retry_records(consumed, origin, offsets):
            if msg.offset() < offsets.get((msg.topic(), msg.partition()), -1):
                found = hop_of(msg)
                if found is not None:
                    self._drop(*found)
                    view = journal.handled.get((found[0], found[2])) if journal is not None else None
                    if view is not None:
                        handled.append(view)
        if journal is not None:
            self._unmark(journal)
            for tp, key, offset, place, consumed_at in journal.wrote:
                if consumed_at is not None and consumed_at[1] >= offsets.get(consumed_at[0], -1):
                    continue  # its record was not committed: nor was the hop, which went with that record's work
                keys = self._keys.setdefault(tp, {})
                entries = keys.get(key)
                if entries is None:
                    entries = keys[key] = {}
                    if key is not None:
                        _mark(self.maybe, key)
                old = entries.get(offset)
                if old is None:
                    self._count += 1
                else:
                    self._due.remove(old.due_ms)
                entries[offset] = place
                self._due.add(place.due_ms)
        self._tell()
        return handled

    def rebuilt(self, tp: TP, in_retry: Iterable[tuple[bytes | None, int, Place]]) -> None:
        """Input partition ``tp``'s keys, from its retry partitions read from the committed offsets to the end:
        ``(key, input offset, place)`` of each hop found, in the order read."""
        keys: dict[bytes | None, Entries] = {}
        for key, offset, place in in_retry:
            keys.setdefault(key, {})[offset] = place
        self._leave(tp)
        if keys:
            self._keys[tp] = keys
            for key, entries in keys.items():
                if key is not None:
                    _mark(self.maybe, key)
                for place in entries.values():
                    self._due.add(place.due_ms)
        self._count += self.in_retry(tp)
        self._tell()

    def forget(self, tps: Iterable[TP]) -> None:
        """Input partitions revoked or lost: their keys go (their next owner rebuilds them)."""
        for tp in tps:
            self._leave(tp)
        self._tell()

    # -- what it holds ---------------------------------------------------------------------
    def in_retry(self, tp: TP | None = None) -> int:
        """How many records are in retry (committed), of ``tp`` or of every input partition."""
        if tp is None:
            return self._count
        return sum(len(entries) for entries in self._keys.get(tp, {}).values())

    def oldest_due_ms(self) -> int | None:
        """When the record in retry due first is due (committed, epoch ms); None when none is in retry."""
        return self._due.earliest()

    def heads(self) -> dict[TP, tuple[int, TP, int, int]]:
        """Each retry partition's record in retry due first (committed): ``retry TP -> (due ms, its input TP, its
        input offset, how many records the retry partition holds)``. What the stall check compares between two
        looks (a scan of the book: it is asked every few tens of seconds, not per record)."""
        heads: dict[TP, tuple[int, TP, int, int]] = {}
        for tp, keys in self._keys.items():
            for entries in keys.values():
                for offset, place in entries.items():
                    where = (place.topic, tp[1])
                    head = heads.get(where)
                    if head is None:
                        heads[where] = (place.due_ms, tp, offset, 1)
                    elif (place.due_ms, offset) < (head[0], head[2]):
                        heads[where] = (place.due_ms, tp, offset, head[3] + 1)
                    else:
                        heads[where] = (*head[:3], head[3] + 1)
        return heads

    def keys_in_retry(self, tp: TP) -> dict[bytes | None, list[int]]:
        """``tp``'s keys in retry (committed), each with its records' input offsets in order."""
        return {key: sorted(entries) for key, entries in self._keys.get(tp, {}).items()}

    # -- inside -----------------------------------------------------------------------------
    def _tell(self) -> None:
        now = (self._count, self._due.earliest())
        if now != self._told and self._on_count is not None:
            self._told = now
            self._on_count(*now)

    def _leave(self, tp: TP) -> None:
        """``tp``'s records leave the book (revoked, or about to be rebuilt)."""
        for key, entries in self._keys.pop(tp, {}).items():
            if key is not None:
                _unmark(self.maybe, key)
            self._count -= len(entries)
            for place in entries.values():
                self._due.remove(place.due_ms)

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
        place = entries.pop(offset, None)
        if place is not None:
            self._count -= 1
            self._due.remove(place.due_ms)
        if not entries:
            del keys[key]
            if key is not None:
                _unmark(self.maybe, key)
            if not keys:
                del self._keys[tp]

    def _unmark(self, journal: _Journal) -> None:
        """``journal``'s hops no longer count in :attr:`maybe` (it committed, or was dropped)."""
        maybe = self.maybe
        for key in journal.marked:
            _unmark(maybe, key)
        journal.marked.clear()


def _mark(maybe: dict[bytes, int], key: bytes) -> None:
    maybe[key] = maybe.get(key, 0) + 1


def _unmark(maybe: dict[bytes, int], key: bytes) -> None:
    count = maybe.get(key, 0)
    if count <= 1:
        maybe.pop(key, None)
    else:
        maybe[key] = count - 1
