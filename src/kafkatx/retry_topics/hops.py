"""What a listener with ``retry="topics"`` does with a record it consumed, and with one whose handler failed.

:class:`RetryHops` is the strategy the record runner hands the failed-record
procedure (:func:`~kafkatx.listener.failure.failed_record.settle_failure`):

- :meth:`RetryHops.view`: the record the handler sees. A record consumed from
  an input topic is itself; one consumed from a retry topic is the input record
  behind it (:func:`~kafkatx.retry_topics.headers.parse_hop`: original topic,
  partition, offset, key, value, own headers and timestamp, ``attempt`` from
  the hop's header);
- :meth:`RetryHops.hop`: the output that sends a failed record's input view to
  the retry topic of its next attempt, on its input partition (a hop keeps the
  record's partition, so whoever owns input partition ``(T, p)`` owns its
  retries too), due ``delay`` after now.

It does no I/O: the output goes to the open transaction through the unit, so
the hop and the offset of the record it replaces commit together.

It holds the container's records in retry (``book``, a :class:`~kafkatx.retry_topics.keys.RetryKeys`, kept
as the transactions commit: the count and earliest due time the metrics publish, and the retries handled); the
retry feed tells it the retry records it hands the container (:meth:`RetryHops.delivered`), so that a commit
finds those it took out of retry among them.
With ``ordering="key"`` the book is also ``keys``, and :meth:`RetryHops.viewing` is then the gate of key order: a
record whose key has an earlier record in retry is not handed to the handler;
it follows that record (:meth:`RetryHops.follow`, sent like a ``send()`` of the
handler, so it commits with the record's offset), its attempt unchanged.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from kafkatx.client.offsets import TP
from kafkatx.context import send
from kafkatx.events import Event, RecordFollowed, RecordsInRetry, RetryHandled
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, Headers, Record
from kafkatx.retry_topics.headers import (
    ATTEMPT_SPANS,
    HOP_ID,
    attempt_spans_of,
    hop_headers,
    hop_origin,
    own_headers,
    parse_hop,
)
from kafkatx.retry_topics.keys import Place, RetryKeys
from kafkatx.retry_topics.plan import RetryTopicPlan
from kafkatx.rollback.policy import FailurePolicy

__all__ = ["HopTrace", "RetryHops"]


log = logging.getLogger("kafkatx.container")

#: How many parsed retry records' origins :class:`RetryHops` keeps for their commit at most (about one
#: transaction's worth of retry records is what it needs).
_ORIGINS_KEPT = 50_000
#: How many of its hops not read back yet :class:`RetryHops` remembers at most (a hop leaves when it is read back;
#: those never read back here, of transactions that aborted or partitions revoked, are dropped past this).
_SENT_KEPT = 50_000
#: What :class:`RetryHops` remembers of a hop it wrote: the input view's topic, partition, offset, own headers,
#: timestamp and timestamp type, and the attempt the hop's delivery is.
_Sent = tuple[str, int, int, Headers, int, str, int]
#: Records written to a retry topic again without being handled (their key's record in retry failed again
#: before they were read back) that make a warning, and how often it is said at most.
REWRITES_WARNED = 100
REWRITE_WARNING_EVERY_S = 300.0
#: How many keys the warning counts rewrites of between two warnings (it names the busiest).
_REWRITTEN_KEYS_KEPT = 1_000


class HopTrace(Protocol):
    """Tracing's side of a hop (kafkatx.tracing's ``HopLinks``): the failed attempts' span contexts a hop
    carries, and what a record read back brings of them."""

    def carried(self, group_id: str, record: Record) -> bytes | None: ...
    def arrived(self, group_id: str, record: Record, value: bytes) -> None: ...


class _Declaration(Protocol):
    """What the retry topics of a listener follow from (a listener spec is one)."""

    @property
    def retry(self) -> str: ...
    @property
    def topics(self) -> tuple[str, ...]: ...
    @property
    def policy(self) -> FailurePolicy: ...
    @property
    def ordering(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def hop_trace(self) -> HopTrace | None: ...


class RetryHops:
    """The retry topics of one listener (``plan`` over its ``inputs``), as the failure procedure uses them."""

    __slots__ = (
        "plan",
        "inputs",
        "group_id",
        "book",
        "keys",
        "written",
        "trace",
        "_origin",
        "_clock",
        "_publish",
        "_listener",
        "_worker",
        "_last",
        "_origins",
        "_uncommitted",
        "_sent",
        "_token",
        "_hops_sent",
        "_rewrites",
        "_rewritten_keys",
        "_rewrites_since",
        "_warned_at",
    )

    def __init__(
        self,
        plan: RetryTopicPlan,
        inputs: Iterable[str],
        group_id: str | None,
        *,
        clock: Callable[[], float] = time.time,
        key_order: bool = False,
        publish: Callable[[Event], None] | None = None,
        listener: str = "",
        trace: HopTrace | None = None,
        worker: int = 0,
    ) -> None:
        self.plan = plan
        self.inputs = tuple(inputs)
        self.group_id = group_id
        #: retry topic -> its input topic
        self._origin = {retry: topic for topic in self.inputs for retry in plan.topics(topic)}
        self._clock = clock
        #: The events' names: the container's (``orders#1`` and worker 1 with concurrency > 1), as its own events.
        self._publish, self._listener, self._worker = publish, listener, worker
        #: The records in retry, as committed (both orderings).
        self.book = RetryKeys(self._origin, self._in_retry if publish is not None else None, key_order=key_order)
        #: ``ordering="key"``: the book, as the gate of key order; None lets records pass each other ("none").
        self.keys = self.book if key_order else None
        #: The retry partitions hops were written to since the feed last looked, and when the first is due (epoch
        #: ms): the feed fetches them then.
        self.written: dict[TP, int] = {}
        #: With tracing on: the failed attempts' span contexts each hop carries (kafkatx.tracing._hops).
        self.trace = trace
        #: The retry record read back last, by its coordinates, and its view: what :meth:`view` answers for it.
        self._last: tuple[tuple[str, int, int], Record] | None = None
        #: What :meth:`hop_of` answers for the retry records :meth:`arrived` parsed, by their coordinates: their
        #: commit reads none of their headers again (taken out as it reads them; cleared past _ORIGINS_KEPT).
        self._origins: dict[tuple[str, int, int], tuple[TP, bytes | None, int]] = {}
        #: The retry records the feed delivered to the container that no commit covered yet, per retry partition, by
        #: offset: what a commit takes out of retry is read here (the records below its offsets), not picked out of
        #: every record of its transaction. Delivered again (fetched again after an abort), a record replaces itself.
        self._uncommitted: dict[TP, dict[int, ConsumedMessage]] = {}
        #: The hops written here and not read back yet, by their ``kafkatx_retry-hop`` header (this object's random
        #: token and a count): what each carries of its input view, so that reading it back parses no header.
        self._sent: dict[bytes, _Sent] = {}
        self._token = os.urandom(8)
        self._hops_sent = 0
        #: Records read back that followed their key's head again (written again, not handled), and of which keys,
        #: since the last warning about them (:meth:`_rewritten`).
        self._rewrites = 0
        self._rewritten_keys: Counter[bytes | None] = Counter()
        self._rewrites_since = clock()
        self._warned_at: float | None = None

    @classmethod
    def of(
        cls,
        spec: _Declaration,
        group_id: str | None,
        publish: Callable[[Event], None] | None = None,
        *,
        container: str | None = None,
        worker: int = 0,
    ) -> RetryHops | None:
        """The retry topics of a listener declared with ``retry="topics"``; None for any other listener. ``publish``:
        where :class:`~kafkatx.events.RecordFollowed`, :class:`~kafkatx.events.RecordsInRetry` and
        :class:`~kafkatx.events.RetryHandled` go, named after ``container`` and ``worker`` (the listener's name and
        0 by default)."""
        if spec.retry != "topics":
            return None
        key_order = spec.ordering == "key"
        return cls(
            RetryTopicPlan(spec.policy),
            spec.topics,
            group_id,
            key_order=key_order,
            publish=publish,
            listener=spec.name if container is None else container,
            trace=spec.hop_trace,
            worker=worker,
        )

    def _in_retry(self, records: int, oldest_due_ms: int | None) -> None:
        if self._publish is not None:
            due = None if oldest_due_ms is None else oldest_due_ms / 1000.0
            self._publish(RecordsInRetry(self._listener, self._worker, records, due))

    def delivered(self, records: Iterable[ConsumedMessage]) -> None:
        """The retry feed hands ``records`` (of retry partitions) to the container: a commit whose offsets pass one
        of them took it out of retry (:meth:`committed`)."""
        uncommitted = self._uncommitted
        for msg in records:
            tp = (msg.topic(), msg.partition())
            by_offset = uncommitted.get(tp)
            if by_offset is None:
                by_offset = uncommitted[tp] = {}
            by_offset[msg.offset()] = msg

    def undelivered(self, tps: Iterable[TP]) -> None:
        """Retry partitions ``tps`` were given up (revoked, closed): their records delivered are forgotten."""
        for tp in tps:
            self._uncommitted.pop(tp, None)

    def _covered(self, offsets: Mapping[TP, int]) -> list[ConsumedMessage]:
        """The records delivered below ``offsets`` (a commit's next offsets), taken out of :attr:`_uncommitted`."""
        uncommitted, covered = self._uncommitted, []
        for tp, end in offsets.items():
            by_offset = uncommitted.get(tp)
            if by_offset:
                for offset in [o for o in by_offset if o < end]:
                    covered.append(by_offset.pop(offset))
        return covered

    def committed(self, txn: object, offsets: Mapping[TP, int]) -> None:
        """Producer ``txn`` committed ``offsets``: the retry records delivered below them leave the book, its hops
        join, and each retry record it committed as handled is told (:class:`~kafkatx.events.RetryHandled`)."""
        handled = self.book.committed(txn, offsets, self._covered(offsets), self.hop_of)
        if len(self._origins) > _ORIGINS_KEPT:  # parsed in transactions that did not commit (aborted, revoked)
            self._origins.clear()
        if handled and self._publish is not None:
            for view in handled:
                self._publish(RetryHandled(self._listener, self._worker, view))

    def viewing(self, handler: Callable[[Record], Any]) -> Callable[[Record], Any]:
        """``handler`` called with each record's view, unless :meth:`admit` says the record follows or passes (what
        it says then is sent as the handler's ``send()``\\ s are). The one-at-a-time runner's handler.

        A record of an input topic costs a dictionary lookup here, and with key order one more when some key is
        in retry (:attr:`~kafkatx.retry_topics.keys.RetryKeys.maybe`); a record read back from a retry topic is
        parsed once (:meth:`arrived`)."""
        origin, handled, admit = self._origin, self.book.handled, self.admit
        maybe = self.keys.maybe if self.keys is not None else None

        def handle(record: Record) -> Any:
            if record.topic in origin or (maybe and record.key in maybe):
                # ``key`` is still the key's bytes here (runners fill it from the Message; typed decoding runs
                # inside this gate): ``raw_key`` would cost a property call.
                seen = admit(record)
                if isinstance(seen, list):  # it passes, or follows its key's record in retry
                    for output in seen:
                        send(*output)
                    return None
                result = handler(seen)
                if seen is not record:
                    handled(seen)
                return result
            return handler(record)

        return handle

    def admit(self, record: Record) -> Record | list[PendingOutput]:
        """What ``record`` (as consumed, from an input or a retry topic) comes to before any handler is called: the
        record its handler is called with (its input view), or the outputs that stand for its handling, produced
        with its offset: none for a hop another consumer group wrote (it passes), or, with key order, the hop that
        sends it behind its key's earlier record in retry (it follows, its attempt unchanged; booked now, counted
        once its record commits). A record read back runs only if it is its key's head by then; otherwise it
        follows again. The caller tells :attr:`book` a read back record it ran whose handler returned
        (:meth:`~kafkatx.retry_topics.keys.RetryKeys.handled`)."""
        keys = self.keys
        if record.topic not in self._origin:
            place = keys.ahead(record) if keys is not None else None
            return record if place is None else [self._follow(record, place, record)]
        seen = self.arrived(record)
        if seen is None:
            return []
        if keys is None:
            return seen
        retried = seen is not record
        if retried:
            keys.consumed(seen)  # read back from a retry topic: no longer ahead of the records after it
        place = keys.ahead(seen)
        if place is None:
            return seen
        followed = self._follow(seen, place, record)
        if retried:
            self._rewritten(seen)
        return [followed]

    @property
    def retry_topics(self) -> tuple[str, ...]:
        """Every retry topic of the listener's input topics."""
        return tuple(self._origin)

    def is_retry_topic(self, topic: str) -> bool:
        return topic in self._origin

    def input_topic(self, topic: str) -> str:
        """The input topic whose records ``topic`` holds: itself, or the one a retry topic is of."""
        return self._origin.get(topic, topic)

    def ran(self, record: Record, seen: Record) -> None:
        """The handler of ``record`` (as :meth:`admit` let it run, called with ``seen``) returned in the open
        transaction: a read back record is noted handled, told once its transaction commits."""
        if seen is not record:
            self.book.handled(seen)

    def mirrored(self, tps: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """The retry partitions owned with input partitions ``tps``: ``(T + suffix, p)`` for each ``(T, p)``."""
        return [(retry, p) for t, p in tps for retry in self.plan.topics(t) if t in self.inputs]

    def view(self, record: Record) -> Record:
        """The record the handler sees: ``record`` itself, or, consumed from a retry topic, its input record."""
        if record.topic not in self._origin:
            return record
        last = self._last
        if last is not None and last[0] == (record.topic, record.partition, record.offset):
            seen = last[1]  # the record read back last (its handler failed): parsed once, unless it was decoded
            if seen.key is seen.raw_key and seen.value is seen.raw_value:
                return seen
        hop = parse_hop(record)
        if hop is None:  # not written by a hop (someone produced to the retry topic): handled as it is
            return record
        return hop.record

    def arrived(self, record: Record) -> Record | None:
        """:meth:`view` of a record consumed from a retry topic, its headers parsed once; None for a hop another
        consumer group wrote (:meth:`foreign`). With tracing on, tracing is told the failed attempts' span contexts
        the hop carries. A hop written here (its first header names one in :attr:`_sent`) is not parsed: its view
        is built from what was remembered of it, the same fields :func:`parse_hop` reads from its headers."""
        headers = record.headers
        sent = self._sent.pop(headers[0][1], None) if headers and headers[0][0] == HOP_ID else None
        if sent is not None:
            topic, partition, offset, own, timestamp, timestamp_type, attempt = sent
            seen = Record(
                topic,
                partition,
                offset,
                record.key,
                record.value,
                own,
                timestamp,
                timestamp_type,
                attempt=attempt,
                raw_key=record.raw_key,
                raw_value=record.raw_value,
            )
        else:
            hop = parse_hop(record)
            if hop is None:  # not written by a hop (someone produced to the retry topic): handled as it is
                return None if self.foreign(headers) else record
            if self._of_another_group(hop.group):
                return None
            seen = hop.record
        at = (record.topic, record.partition, record.offset)
        self._last = (at, seen)
        self._origins[at] = ((seen.topic, seen.partition), record.raw_key, seen.offset)
        trace = self.trace
        if trace is not None and self.group_id is not None:
            spans = attempt_spans_of(record.headers)
            if spans is not None:
                trace.arrived(self.group_id, seen, spans)
        return seen

    def _with_spans(self, view: Record, headers: Headers) -> None:
        """With tracing on, ``headers`` (a hop of ``view``) also carry its failed attempts' span contexts."""
        trace = self.trace
        if trace is not None and self.group_id is not None:
            spans = trace.carried(self.group_id, view)
            if spans is not None:
                headers.append((ATTEMPT_SPANS, spans))

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def hop(
        self, view: Record, exception: BaseException, failures: int, delay: float, consumed: Record | None = None
    ) -> PendingOutput | None:
        """The output sending ``view`` (an input record that failed its ``failures``-th attempt) to the retry
        topic of its next attempt, due ``delay`` seconds from now; None if the plan has no retry left.
        ``consumed``: the record as consumed (from an input or a retry topic), whose commit the hop's counts with."""
        level = self.plan.level_for(failures)
        if level is None:
            return None
        due_ms = self.now_ms() + round(delay * 1000)
        headers = hop_headers(view, exception, group_id=self.group_id, next_attempt=failures + 1, due_ms=due_ms)
        headers.insert(0, (HOP_ID, self._remember(view, failures + 1)))
        self._with_spans(view, headers)
        topic = view.topic + level.suffix
        self.book.wrote(view, Place(topic, due_ms), None if consumed is None else _at(consumed))
        self._written_to((topic, view.partition), due_ms)
        return (topic, view.raw_value, view.raw_key, headers, view.partition)

    def follow(self, view: Record, place: Place) -> None:
        """Send ``view`` behind its key's head, to ``place`` (the head's retry topic, due when it is), in the
        handler's transaction (as its ``send()``): no attempt spent, no failure to name."""
        send(*self._follow(view, place, None))

    def _follow(self, view: Record, place: Place, consumed: Record | None) -> PendingOutput:
        """The output that sends ``view`` behind its key's head (:meth:`follow`), booked for the commit of
        ``consumed`` (the record as consumed)."""
        attempt = max(view.attempt, 1)
        headers = hop_headers(view, None, group_id=self.group_id, next_attempt=attempt, due_ms=place.due_ms)
        headers.insert(0, (HOP_ID, self._remember(view, attempt)))
        self._with_spans(view, headers)
        self._written_to((place.topic, view.partition), place.due_ms)
        self.book.wrote(view, place, None if consumed is None else _at(consumed))
        if self._publish is not None:
            self._publish(RecordFollowed(self._listener, self._worker, view, place.topic))
        return (place.topic, view.raw_value, view.raw_key, headers, view.partition)

    def _remember(self, view: Record, attempt: int) -> bytes:
        """The ``kafkatx_retry-hop`` header of a hop of ``view`` whose delivery is ``attempt``, remembered with what
        :meth:`arrived` hands back for it."""
        self._hops_sent += 1
        hop_id = self._token + self._hops_sent.to_bytes(8, "big")
        sent = self._sent
        if len(sent) >= _SENT_KEPT:
            sent.clear()  # hops never read back here: those still to come are parsed
        sent[hop_id] = (
            view.topic,
            view.partition,
            view.offset,
            own_headers(view.headers),
            view.timestamp,
            view.timestamp_type,
            attempt,
        )
        return hop_id

    def _rewritten(self, view: Record) -> None:
        """``view``, read back from a retry topic, followed its key's head again: written to the retry topic once
        more without being handled. Counted, and said in a warning (at most every
        :data:`REWRITE_WARNING_EVERY_S`) once :data:`REWRITES_WARNED` add up: a key whose records keep arriving
        while one of them fails again and again sends its whole flow through the retry topics, many times over,
        and nothing else shows it (docs/RETRY_TOPICS.md, "A key that never drains")."""
        self._rewrites += 1
        keys = self._rewritten_keys
        if view.raw_key in keys or len(keys) < _REWRITTEN_KEYS_KEPT:
            keys[view.raw_key] += 1
        if self._rewrites < REWRITES_WARNED:
            return
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < REWRITE_WARNING_EVERY_S:
            return
        ((key, times),) = keys.most_common(1)
        log.warning(
            "listener %s: %d record(s) read back from the retry topics in the last %.0fs followed their key's record "
            "in retry again (it failed again before they were read back), so they were written to the retry topics "
            'again without being handled; the most of them of key %r (%d). With ordering="key" every record of a '
            "key that keeps arriving while one of its records is in retry goes through the retry topics, and again "
            "at each new failure of that record: with few keys per partition, that is most of the flow. "
            'retry="rollback" holds the partition instead, ordering="none" lets records pass '
            '(docs/RETRY_TOPICS.md, "A key that never drains").',
            self._listener,
            self._rewrites,
            now - self._rewrites_since,
            key if key is None or len(key) <= 64 else key[:64] + b"...",
            times,
        )
        self._warned_at = self._rewrites_since = now
        self._rewrites = 0
        keys.clear()

    def _written_to(self, tp: TP, due_ms: int) -> None:
        written = self.written
        if due_ms < written.get(tp, due_ms + 1):
            written[tp] = due_ms

    def hop_of(self, msg: ConsumedMessage) -> tuple[TP, bytes | None, int] | None:
        """The input partition, key and input offset of a record consumed from a retry topic; None if no hop."""
        known = self._origins.pop((msg.topic(), msg.partition(), msg.offset()), None)
        if known is not None:
            return known
        origin = hop_origin(msg.headers())
        if origin is None or self._of_another_group(origin[3]):
            return None
        return (origin[0], origin[1]), msg.key(), origin[2]

    def foreign(self, headers: Headers | None) -> bool:
        """True for a hop another consumer group wrote (groups reading one input topic share its retry topics):
        that group handles it; this one lets it pass, committed like a record with nothing to produce."""
        origin = hop_origin(headers)
        return origin is not None and self._of_another_group(origin[3])

    def _of_another_group(self, group: str | None) -> bool:
        return group is not None and self.group_id is not None and group != self.group_id


def _at(record: Record) -> tuple[TP, int]:
    """Where ``record`` was consumed: its partition and offset."""
    return (record.topic, record.partition), record.offset
