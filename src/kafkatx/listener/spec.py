"""A listener's declaration: its handler, topics and options, validated up front.

Everything a user can get wrong is checked when the decorator runs, so a bad
option fails at import time with a message naming it, not at 3 a.m.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kafkatx.client.properties import check_property_names
from kafkatx.database.backend import Backend, backend_for
from kafkatx.errors import InvalidConfigurationError
from kafkatx.listener.options import LISTENER_DEFAULTS, Fencing, Ordering, RetryMode, check_option_names
from kafkatx.outputs import Serializer
from kafkatx.recoverers import LoggingRecoverer, Recoverer, as_recoverer
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.rollback.policy import FailurePolicy
from kafkatx.rollback.processor import AfterRollbackProcessor, DefaultAfterRollbackProcessor
from kafkatx.serde import (
    RegistrySerializer,
    TypedDecoding,
    output_serializer,
    registry_handler,
    typed_decoding,
    typed_handler,
)

if TYPE_CHECKING:
    from kafkatx.listener.host import RunnerFactory, UntracedRoots
    from kafkatx.retry_topics.hops import HopTrace

__all__ = ["ListenerSpec", "build_spec", "is_async_handler", "validate_topic"]

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

#: Options that make up the failure policy; with after_rollback=DefaultAfterRollbackProcessor(...) they live there.
_POLICY_OPTIONS = (
    "max_attempts",
    "backoff",
    "dlq",
    "not_retryable",
    "retryable",
    "default_not_retryable",
    "max_recovery_failures",
    "recovery_backoff",
)


def validate_topic(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _TOPIC.match(name) or name in (".", ".."):
        raise InvalidConfigurationError(
            f"{what} {name!r} is not a valid Kafka topic name (1-249 characters of letters, digits, '.', '_', '-')"
        )
    return name


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(slots=True)
class ListenerSpec:
    """Everything a container needs to run one listener (read-only once declared)."""

    name: str
    handler: Callable[..., Any]
    topics: tuple[str, ...]
    policy: FailurePolicy
    processor: AfterRollbackProcessor
    output: str | None = None
    #: Topics the handler reaches with send(): checked (or created) at start like ``output``.
    sends_to: tuple[str, ...] = ()
    kind: Literal["record", "batch"] = "record"
    max_batch_records: int = 5000
    max_batch_ms: int = 100
    max_transaction_ms: int | None = None
    fencing: Fencing = "auto"
    concurrency: int = 1
    dlq_topic: str | None = None
    retry: RetryMode = "rollback"
    serializer: Serializer | None = None
    group_id: str | None = None
    consumer_config: dict[str, Any] = field(default_factory=dict)
    producer_config: dict[str, Any] = field(default_factory=dict)
    max_abortable_retries: int = 5
    idle_event_interval: float | None = None
    #: Commits claim the batch in flight, so a record that kills the process is counted
    #: (listener/failure/crash_guard.py).
    count_crashes: bool = True
    #: ``database=``: the database whose transaction joins each Kafka transaction (kafkatx.database).
    database: Backend | None = None
    #: Exception types that mean "a dependency is down": the listener pauses, no attempt is counted
    #: (listener/failure/outage.py).
    outages: tuple[type[BaseException], ...] = (ConnectionError,)
    #: Stop the App once an outage lasts longer than this many seconds (None: wait for as long as it takes).
    max_outage: float | None = None
    #: Builds the container's runner (``None``: the record runner). Spark listeners set it.
    runner: RunnerFactory | None = None
    #: How many records of a container are handled at once (docs/CONCURRENCY.md); 1: one after the other.
    in_flight: int = 1
    #: Which records wait for each other when ``in_flight > 1``: same key, same partition, or none.
    ordering: Ordering = "key"
    #: The handler is an ``async def``: awaited on the container's event loop.
    is_async: bool = False
    #: The handler takes a list of Records (a batch listener's; not a Spark job's DataFrame).
    records_handler: bool = False
    #: ``value_type=``, ``deserializer=``...: how records are decoded before ``handler`` (which then wraps the
    #: user's handler: kafkatx.serde.typed_handler); None for bytes.
    decoding: TypedDecoding | None = None
    #: Handle the next batch while a transaction commits, holding its outputs (listener/loop/overlap.py, docs/OVERLAP.md).
    overlap_commit: bool = False
    #: Work the container does while each of its transactions commits, the thread being idle then (tracing makes
    #: its deferred record spans: kafkatx.tracing._deferred). Set by the App, not declared.
    while_committing: Callable[[], None] | None = None
    #: Tracing's root records sampled out, which the record runner runs with the untraced handler
    #: (listener.host.UntracedRoots). Set by the App, not declared.
    untraced_roots: UntracedRoots | None = None
    #: ``retry="topics"`` with tracing on: the failed attempts' span contexts a hop carries
    #: (kafkatx.tracing._hops). Set by the App, not declared.
    hop_trace: HopTrace | None = None

    @property
    def recoverer(self) -> Recoverer:
        return self.policy.recoverer


def build_spec(
    handler: Any,
    topics: Iterable[str],
    options: Mapping[str, Any],
    *,
    kind: Literal["record", "batch"] = "record",
    runner: RunnerFactory | None = None,
    where: str = "listener",
    records_handler: bool = False,
) -> ListenerSpec:
    """Validate listener ``options`` (see :class:`~kafkatx.listener.options.ListenerOptions`) into a spec.

    ``records_handler``: the runner calls the handler with a list of Records (a batch listener): it awaits an
    ``async def`` handler and decodes typed payloads itself (``spec.decoding``, the handler left unwrapped).
    """
    check_option_names(options, LISTENER_DEFAULTS, where)
    opts = {**LISTENER_DEFAULTS, **options}
    if not callable(handler):
        raise InvalidConfigurationError(
            f"a listener handler must be callable (a function taking a Record), got {type(handler).__name__} {handler!r}"
        )
    _check_not_async(handler, kind, runner, records_handler)
    if kind == "record" or records_handler:
        _check_takes_one_argument(handler)
    topics, output, sends_to = _topics_of(topics, opts)
    name = opts["name"] or getattr(handler, "__qualname__", None) or type(handler).__name__
    on_topics = f"topic{'s' if len(topics) > 1 else ''} {', '.join(topics)}"
    fencing, retry, idle, serializer, max_batch_ms = _check_modes_and_limits(opts, f"{where} {name!r} ({on_topics})")
    policy, processor, dlq_topic = _failure_handling(opts, options, topics, retry)
    in_flight, ordering, is_async = _concurrency_of(handler, opts, options, kind, runner, records_handler)
    database = _database_of(opts.get("database"), kind, runner, retry, records_handler)
    if retry == "topics":
        _check_retry_topics(opts, options, kind, runner, f"{where} {name!r} ({on_topics})")
    decoding = _decoding_of(opts, kind, runner, records_handler)
    serializer = output_serializer(serializer, decoding is not None, output)
    handler_called = handler if decoding is None or records_handler else typed_handler(handler, decoding)
    if isinstance(serializer, RegistrySerializer) and runner is None:  # a Spark job's result is not encoded here
        handler_called = registry_handler(handler_called, serializer, is_async)
    return ListenerSpec(
        name=name,
        handler=handler_called,
        topics=topics,
        policy=policy,
        processor=processor,
        output=output,
        sends_to=sends_to,
        kind=kind,
        # A batch holds at least in_flight records unless told otherwise: fewer could never all be in flight.
        max_batch_records=max(
            _positive_int(opts["max_batch_records"], "max_batch_records"),
            in_flight if "max_batch_records" not in options else 1,
        ),
        max_batch_ms=max_batch_ms,
        max_transaction_ms=opts["max_transaction_ms"],
        fencing=fencing,
        concurrency=_positive_int(opts["concurrency"], "concurrency"),
        dlq_topic=dlq_topic,
        retry=retry,
        serializer=serializer,
        group_id=opts["group_id"],
        consumer_config=dict(opts["consumer_config"] or {}),
        producer_config=dict(opts["producer_config"] or {}),
        max_abortable_retries=_positive_int(opts["max_abortable_retries"], "max_abortable_retries", 0),
        idle_event_interval=idle,
        count_crashes=_flag(opts.get("count_crashes", True), "count_crashes") and (kind == "record" or records_handler),
        runner=runner,
        database=database,
        outages=_exception_types(opts.get("outages", (ConnectionError,)), "outages"),
        max_outage=_seconds_or_none(opts.get("max_outage"), "max_outage"),
        in_flight=in_flight,
        ordering=ordering,
        is_async=is_async,
        records_handler=records_handler,
        decoding=decoding,
        overlap_commit=_overlap_commit(options, database is not None, kind, runner, in_flight, is_async),
    )


def _overlap_commit(
    options: Mapping[str, Any], database: bool, kind: str, runner: RunnerFactory | None, in_flight: int, is_async: bool
) -> bool:
    """``overlap_commit`` (off by default, docs/OVERLAP.md says why); asked for where it cannot run, refused."""
    flag = _flag(options.get("overlap_commit", LISTENER_DEFAULTS["overlap_commit"]), "overlap_commit")
    why = (
        "database= (the database transaction is committed with the Kafka one, so a handler's database work "
        "cannot run ahead of it)"
        if database
        else "a Spark or batch listener (a job runs per transaction)"
        if kind != "record" or runner is not None
        else f"in_flight={in_flight} (records handled concurrently)"
        if in_flight > 1
        else "an async def handler"
        if is_async
        else None
    )
    if why is None:
        return flag
    if options.get("overlap_commit") is True:
        raise InvalidConfigurationError(
            f"overlap_commit=True cannot go with {why}: drop overlap_commit (it is then off for this listener)"
        )
    return False


def _concurrency_of(
    handler: Any,
    opts: Mapping[str, Any],
    given: Mapping[str, Any],
    kind: str,
    runner: RunnerFactory | None,
    records_handler: bool = False,
) -> tuple[int, Ordering, bool]:
    """``in_flight``, ``ordering`` and whether the handler is awaited; what cannot be made right is refused."""
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    in_flight = _positive_int(opts["in_flight"], "in_flight")
    ordering = opts["ordering"]
    if ordering is None:
        ordering = "key"
    elif ordering not in ("key", "partition", "none"):
        raise InvalidConfigurationError(f"ordering must be 'key', 'partition' or 'none', got {ordering!r}")
    is_async = is_async_handler(handler)
    if in_flight == 1 and (not is_async or records_handler):  # a batch runner awaits its handler itself
        return in_flight, ordering, is_async
    what = f"in_flight={in_flight}" if in_flight > 1 else "an async def handler"
    if kind != "record" or runner is not None:
        raise InvalidConfigurationError(f"listener {name}: {what} is for record listeners (@app.listener) only")
    if opts["database"] is not None:
        raise InvalidConfigurationError(
            f"listener {name}: database= cannot be combined with {what} yet (one database transaction is joined by "
            "one handler at a time): drop database=, or use in_flight=1 with a def handler"
        )
    max_batch_records = opts["max_batch_records"]
    if "max_batch_records" in given and isinstance(max_batch_records, int) and max_batch_records < in_flight:
        raise InvalidConfigurationError(
            f"listener {name}: max_batch_records={max_batch_records} is below in_flight={in_flight}: no more "
            f"records than a batch holds can be in flight at once; raise max_batch_records to at least {in_flight}"
        )
    return in_flight, ordering, is_async


def _decoding_of(
    opts: Mapping[str, Any], kind: str, runner: RunnerFactory | None, records_handler: bool = False
) -> TypedDecoding | None:
    """``value_type=``, ``key_type=``, ``deserializer=``, ``key_deserializer=``: record listeners only."""
    given = {k: opts.get(k) for k in ("value_type", "key_type", "deserializer", "key_deserializer")}
    if all(v is None for v in given.values()):
        return None
    if (kind != "record" or runner is not None) and not records_handler:
        named = ", ".join(f"{k}=" for k, v in given.items() if v is not None)
        raise InvalidConfigurationError(f"{named} is available on record listeners (@app.listener) only")
    return typed_decoding(**given)


def _exception_types(value: Any, name: str) -> tuple[type[BaseException], ...]:
    """A tuple of exception classes (one class alone is accepted too)."""
    if isinstance(value, type):
        value = (value,)
    try:
        types = tuple(value or ())
    except TypeError:
        types = (value,)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise InvalidConfigurationError(f"{name} must be exception classes, got {t!r}")
    return types


def _seconds_or_none(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidConfigurationError(f"{name} must be a number of seconds > 0 or None, got {value!r}")
    return float(value)


def _topics_of(topics: Iterable[str], opts: Mapping[str, Any]) -> tuple[tuple[str, ...], str | None, tuple[str, ...]]:
    """The input topics, the output topic and the ``sends_to`` topics, each a valid name, with no loop."""
    topics = tuple(topics)
    if not topics:
        raise InvalidConfigurationError("a listener needs at least one input topic")
    for t in topics:
        validate_topic(t, "input topic")
    if len(set(topics)) != len(topics):
        raise InvalidConfigurationError(f"input topics listed twice: {topics}")
    output = opts["output"]
    if output is not None:
        validate_topic(output, "output topic")
        if output in topics:
            raise InvalidConfigurationError(
                f"output topic {output!r} is also an input topic of the same listener (a loop)"
            )
    sends_to = opts["sends_to"]
    if isinstance(sends_to, str):
        sends_to = (sends_to,)
    try:
        sends_to = tuple(validate_topic(t, "sends_to topic") for t in sends_to)
    except TypeError:
        raise InvalidConfigurationError(f"sends_to must be topic names, got {opts['sends_to']!r}") from None
    return topics, output, sends_to


def _check_modes_and_limits(
    opts: Mapping[str, Any], listener: str
) -> tuple[Fencing, RetryMode, float | None, Serializer | None, int]:
    """Check the fencing and retry modes, the time limits, the serializer and the client configs.

    ``listener`` names the listener in a client config's error (``listener 'bill' (topic orders)``).

    Returns ``(fencing, retry, idle_event_interval, serializer, max_batch_ms)``.
    """
    fencing, retry = opts["fencing"], opts["retry"]
    if fencing not in ("auto", "group", "partition"):
        raise InvalidConfigurationError(
            f"fencing must be 'auto', 'group' (KIP-447) or 'partition' (KIP-98), got {fencing!r}"
        )
    if retry not in ("rollback", "in_place", "topics"):
        raise InvalidConfigurationError(f"retry must be 'rollback', 'in_place' or 'topics', got {retry!r}")
    if retry == "in_place":
        _deprecated(
            f'{listener}: retry="in_place" is deprecated: the default now retries a failed record inside the '
            "batch's transaction too (with backoff=0, exactly as in place), and with a back-off it holds only the "
            "record's partition, where in_place holds the whole transaction open; drop the option (docs/FAILURES.md)"
        )
    idle = opts["idle_event_interval"]
    if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle <= 0):
        raise InvalidConfigurationError(f"idle_event_interval must be a number of seconds > 0, got {idle!r}")
    if opts["max_transaction_ms"] is not None:
        _positive_int(opts["max_transaction_ms"], "max_transaction_ms")
    serializer = opts["serializer"]
    if serializer is not None and not callable(serializer):
        raise InvalidConfigurationError(f"serializer must be callable, got {serializer!r}")
    max_batch_ms = _positive_int(opts["max_batch_ms"], "max_batch_ms", 0)
    for key in ("consumer_config", "producer_config"):
        if opts[key] is not None and not isinstance(opts[key], Mapping):
            raise InvalidConfigurationError(f"{key} must be a mapping of librdkafka properties, got {opts[key]!r}")
        check_property_names(f"{listener} {key}", opts[key] or {})
    return fencing, retry, float(idle) if idle is not None else None, serializer, max_batch_ms


def _check_retry_topics(
    opts: Mapping[str, Any],
    given: Mapping[str, Any],
    kind: str,
    runner: RunnerFactory | None,
    listener: str,
) -> None:
    """``retry="topics"`` (issue 40, docs/RETRY_TOPICS.md): what it does not go with yet is refused, by option."""
    why = (
        'retry="topics" is available on record listeners (@app.listener) only'
        if kind != "record" or runner is not None
        else 'retry="topics" cannot keep partition order (ordering="partition"): a record in retry would hold '
        'back every later record of its partition, which is what retry="rollback" does without the topics; use '
        'ordering="key" (the default: a record follows its key\'s record in retry) or ordering="none"'
        if opts["ordering"] == "partition"
        else 'retry="topics" cannot go with a custom after_rollback processor (a failed record is written to a '
        "retry topic in the open transaction, without calling it): drop after_rollback="
        if opts["after_rollback"] is not None
        else 'retry="topics" cannot go with database= yet (the database position store knows input partitions '
        'only): drop database=, or use retry="rollback"'
        if opts["database"] is not None
        else 'retry="topics" cannot go with overlap_commit=True (the overlapped commit polls the input topics '
        "only): drop overlap_commit"
        if given.get("overlap_commit") is True
        else None
    )
    if why is not None:
        raise InvalidConfigurationError(f"{listener}: {why}")


def _database_of(
    database: Any, kind: str, runner: RunnerFactory | None, retry: str, records_handler: bool = False
) -> Backend | None:
    """The backend of ``database=``: record and batch listeners (not Spark's), and not with in-place retries."""
    if database is None:
        return None
    if (kind != "record" or runner is not None) and not records_handler:
        raise InvalidConfigurationError(
            "database= is available on record and batch listeners (@app.listener, @app.batch_listener) only"
        )
    if retry == "in_place":
        raise InvalidConfigurationError(
            'database= cannot be combined with retry="in_place" (deprecated): it would wait out each back-off '
            'with both transactions open, holding their locks; use retry="rollback" (the default)'
        )
    return backend_for(database)


def _failure_handling(
    opts: Mapping[str, Any], given: Mapping[str, Any], topics: tuple[str, ...], retry: str
) -> tuple[FailurePolicy, AfterRollbackProcessor, str | None]:
    """The listener's failure policy and after-rollback processor.

    With ``after_rollback=DefaultAfterRollbackProcessor(...)`` the processor's
    policy is the listener's (in-place retries and the recovery of failed
    recoveries follow it too); the policy options may not also be given on the
    listener, since one of the two would be silently ignored.
    """
    after_rollback = opts["after_rollback"]
    if after_rollback is not None and not callable(getattr(after_rollback, "process", None)):
        raise InvalidConfigurationError(
            f"after_rollback must be an AfterRollbackProcessor (an object with process(context)), got {after_rollback!r}"
        )
    if isinstance(after_rollback, DefaultAfterRollbackProcessor):
        both = [key for key in _POLICY_OPTIONS if key in given]
        if both:
            raise InvalidConfigurationError(
                f"{', '.join(both)} given both on the listener and through after_rollback="
                "DefaultAfterRollbackProcessor(...): set them in one place (the processor's settings would win)"
            )
        return after_rollback.policy, after_rollback, _dlq_topic(after_rollback.policy.recoverer)
    if after_rollback is not None and retry == "in_place":
        raise InvalidConfigurationError(
            'retry="in_place" cannot follow a custom after_rollback processor (in-place retries decide inside the '
            'batch\'s transaction, without calling it): use retry="rollback", or pass a DefaultAfterRollbackProcessor'
        )
    try:
        classifier = ExceptionClassifier(
            opts["not_retryable"], retryable=opts["retryable"], include_defaults=opts["default_not_retryable"]
        )
        recoverer, dlq_topic = _recoverer(opts["dlq"], topics)
        policy = FailurePolicy(
            recoverer,
            max_attempts=opts["max_attempts"],
            backoff=opts["backoff"],
            classifier=classifier,
            max_recovery_failures=opts["max_recovery_failures"],
            recovery_backoff=opts["recovery_backoff"],
        )
    except (TypeError, ValueError) as exc:
        raise InvalidConfigurationError(str(exc)) from exc
    return policy, after_rollback or DefaultAfterRollbackProcessor(policy=policy), dlq_topic


def _recoverer(dlq: Any, topics: tuple[str, ...]) -> tuple[Recoverer, str | None]:
    if dlq is False or dlq is None:
        return LoggingRecoverer(), None
    if dlq is True or isinstance(dlq, str):
        from kafkatx.dlq.publisher import DeadLetterPublishingRecoverer

        topic: str | None = None
        if isinstance(dlq, str):
            topic = validate_topic(dlq, "dead-letter topic")
            if topic in topics:
                raise InvalidConfigurationError(f"dead-letter topic {dlq!r} is also an input topic")
        return DeadLetterPublishingRecoverer(topic), topic
    if callable(dlq):
        return as_recoverer(dlq), _dlq_topic(dlq)
    raise InvalidConfigurationError(
        f"dlq must be False, True (<topic>-dlt), a topic name, or a recoverer (record, exception) -> None; got {dlq!r}"
    )


def _dlq_topic(recoverer: Any) -> str | None:
    topic = getattr(recoverer, "topic", None)
    return topic if isinstance(topic, str) else None


def is_async_handler(handler: Any) -> bool:
    """Whether calling ``handler`` returns a coroutine to await (an ``async def``, or an object whose ``__call__`` is)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))


def _check_not_async(handler: Any, kind: str, runner: RunnerFactory | None, records_handler: bool = False) -> None:
    """Refuse an ``async def`` handler where it would not be awaited (it would fail every record)."""
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    if inspect.isasyncgenfunction(handler) or inspect.isasyncgenfunction(getattr(handler, "__call__", None)):
        raise InvalidConfigurationError(
            f"listener handler {name} is an async generator, which kafkatx cannot produce from: "
            "declare it def and return a list of outputs (or call kafkatx.send() for each)"
        )
    if not is_async_handler(handler) or records_handler:
        return
    if kind != "record" or runner is not None:
        raise InvalidConfigurationError(
            f"spark/batch listener handler {name} is an async def: a batch job is called, not awaited; declare it def"
        )


def _check_takes_one_argument(handler: Callable[..., Any]) -> None:
    """A record handler is called as ``handler(record)``: say so now if it cannot be."""
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # builtins and some C callables have no signature: trust them
        return
    try:
        signature.bind(object())
    except TypeError as exc:
        name = getattr(handler, "__qualname__", repr(handler))
        raise InvalidConfigurationError(
            f"listener handler {name}{signature} cannot be called with one Record ({exc}): "
            "declare it as def handler(record: Record) -> ... (a batch listener's: handler(records: list[Record]))"
        ) from None


def _deprecated(message: str) -> None:
    """A DeprecationWarning pointing at the user's declaration (the first frame outside kafkatx)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("kafkatx"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
