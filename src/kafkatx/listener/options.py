"""The options of a listener declaration, typed, so that editors complete them and type checkers check them.

``App.listener``, ``App.add_listener`` and ``App.spark_listener`` take them
as keyword arguments (``**options: Unpack[ListenerOptions]``); their
``inspect.signature`` lists every option with its default. A misspelt option
is an :class:`~kafkatx.InvalidConfigurationError` that suggests the closest
name, raised when the decorator runs.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ForwardRef, Literal, TypedDict

from tenacity.wait import wait_base

from kafkatx.errors import InvalidConfigurationError
from kafkatx.record import Record
from kafkatx.recoverers import Recoverer

__all__ = [
    "ListenerOptions",
    "SparkListenerOptions",
    "BatchListenerOptions",
    "LISTENER_DEFAULTS",
    "check_option_names",
    "signature_with_options",
]

Fencing = Literal["auto", "group", "partition"]
RetryMode = Literal["rollback", "in_place", "topics"]
Ordering = Literal["key", "partition", "none"]
Backoff = wait_base | float | None
DeadLetter = bool | str | Recoverer | Callable[[Record, BaseException], object] | None


class _SharedOptions(TypedDict, total=False):
    """The options record and Spark listeners share."""

    name: str
    output: str | None
    sends_to: Iterable[str]
    max_batch_records: int
    max_batch_ms: int
    max_transaction_ms: int | None
    fencing: Fencing
    concurrency: int
    max_attempts: int
    backoff: Backoff
    dlq: DeadLetter
    not_retryable: Iterable[type[BaseException]]
    retryable: Iterable[type[BaseException]]
    default_not_retryable: bool
    max_recovery_failures: int | None
    recovery_backoff: Backoff
    serializer: Callable[[Any], bytes] | None
    group_id: str | None
    consumer_config: Mapping[str, Any]
    producer_config: Mapping[str, Any]
    max_abortable_retries: int
    idle_event_interval: float | None


class ListenerOptions(_SharedOptions, total=False):
    """Keyword options of ``@app.listener`` (see the README for each one's meaning)."""

    after_rollback: Any
    retry: RetryMode
    count_crashes: bool
    database: Any
    outages: Iterable[type[BaseException]]
    max_outage: float | None
    in_flight: int
    ordering: Ordering | None
    value_type: Any
    key_type: Any
    deserializer: Callable[..., Any] | None
    key_deserializer: Callable[..., Any] | None
    overlap_commit: bool


class SparkListenerOptions(_SharedOptions, total=False):
    """Keyword options of ``@app.spark_listener``: the listener's, minus per-record ones, plus ``max_bisect_jobs``."""

    max_bisect_jobs: int


class BatchListenerOptions(_SharedOptions, total=False):
    """Keyword options of ``@app.batch_listener``: the listener's that apply to a batch, plus ``max_bisect_jobs``
    (the budget of poison isolation, named as for Spark listeners)."""

    count_crashes: bool
    database: Any
    outages: Iterable[type[BaseException]]
    max_outage: float | None
    value_type: Any
    key_type: Any
    deserializer: Callable[..., Any] | None
    key_deserializer: Callable[..., Any] | None
    max_bisect_jobs: int


#: The defaults of every listener option (what the signature shows).
LISTENER_DEFAULTS: dict[str, Any] = {
    "name": None,
    "output": None,
    "sends_to": (),
    "max_batch_records": 5000,
    "max_batch_ms": 100,
    "max_transaction_ms": None,
    "fencing": "auto",
    "concurrency": 1,
    "max_attempts": 3,
    "backoff": 1.0,
    "dlq": False,
    "not_retryable": (),
    "retryable": (),
    "default_not_retryable": True,
    "after_rollback": None,
    "max_recovery_failures": None,
    "recovery_backoff": None,
    "retry": "rollback",
    "serializer": None,
    "group_id": None,
    "consumer_config": None,
    "producer_config": None,
    "max_abortable_retries": 5,
    "idle_event_interval": None,
    "count_crashes": True,
    "database": None,
    "outages": (ConnectionError,),
    "max_outage": None,
    "in_flight": 1,
    "ordering": None,
    "value_type": None,
    "key_type": None,
    "deserializer": None,
    "key_deserializer": None,
    "overlap_commit": False,
}


def check_option_names(options: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Reject unknown options with the closest valid name, before anything else is validated."""
    allowed = list(allowed)
    for key in options:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid options: {', '.join(sorted(allowed))}"
            raise InvalidConfigurationError(f"{where} got an unknown option {key!r}{hint}")


def signature_with_options(
    fn: Callable[..., Any], options: type[Any], defaults: Mapping[str, Any]
) -> inspect.Signature:
    """``fn``'s signature with ``**options`` spelt out as keyword-only parameters (for help() and editors)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = options.__annotations__
    for key, hint in hints.items():
        # A TypedDict keeps postponed annotations as ForwardRefs: show their text, as for the other parameters.
        annotation = hint.__forward_arg__ if isinstance(hint, ForwardRef) else hint
        params.append(
            inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(key), annotation=annotation)
        )
    return sig.replace(parameters=params)
