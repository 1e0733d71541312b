"""Which handler exceptions are worth retrying.

Like Spring's ExceptionClassifier, a type listed as not retryable matches the
exception or anything on its ``__cause__``/``__context__`` chain, and such a
record is recovered at its first failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tenacity import RetryCallState
from tenacity.retry import retry_base

from kafkatx.errors import DecodeError, DeserializationError, OutputError
from kafkatx.errors.dbapi import permanent_database_error_class

__all__ = [
    "DEFAULT_NOT_RETRYABLE",
    "ExceptionClassifier",
    "retry_if_retryable",
    "cause_chain",
    "root_cause",
    "exception_fqcn",
    "exception_name",
]


DEFAULT_NOT_RETRYABLE: tuple[type[BaseException], ...] = (
    DeserializationError,  # kafkatx's own marker for undecodable records
    json.JSONDecodeError,  # malformed JSON payloads
    UnicodeDecodeError,  # payloads that are not valid text
    OutputError,  # a handler returned something that cannot be produced
    TypeError,  # programming/type errors repeat on every attempt (Spring: ClassCastException)
)


def cause_chain(exc: BaseException) -> list[BaseException]:
    """The exception, then its causes (``__cause__``, else ``__context__``), without cycles.

    A list built by a plain loop, not a generator: a failure asks for it several times (its verdict, the outage
    check, its headers), and most exceptions have no cause at all."""
    chain = [exc]
    current = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if current is None:
        return chain
    seen = {id(exc)}
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def root_cause(exc: BaseException) -> BaseException:
    return cause_chain(exc)[-1]


def exception_fqcn(exc: BaseException) -> str:
    """``module.Qualname`` of an exception, or the original class a wrapper reports.

    Wrappers that lose the original object (a Spark job error, for example)
    expose ``original_fqcn``.
    """
    original = getattr(exc, "original_fqcn", None)
    if isinstance(original, str) and original:
        return original
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def exception_name(exc: BaseException) -> str:
    """How a log line names an exception: its class's name, or the original class a wrapper reports (a Spark job
    error), as the dead letter's ``kafka_dlt-exception-fqcn`` header does: one name for one failure."""
    original = getattr(exc, "original_fqcn", None)
    return original if isinstance(original, str) and original else type(exc).__name__


class ExceptionClassifier:
    """Decides retryable vs not, walking the cause chain.

    ``not_retryable`` adds to the default set unless ``include_defaults`` is
    False; ``retryable`` carves exceptions back out (it wins over a matching
    not-retryable base class only when it is the more specific match).
    """

    def __init__(
        self,
        not_retryable: Iterable[type[BaseException]] = (),
        *,
        retryable: Iterable[type[BaseException]] = (),
        include_defaults: bool = True,
    ) -> None:
        nr = tuple(not_retryable)
        rt = tuple(retryable)
        for t in (*nr, *rt):
            if not (isinstance(t, type) and issubclass(t, BaseException)):
                raise TypeError(f"not_retryable/retryable must hold exception types, got {t!r}")
        self.not_retryable = (DEFAULT_NOT_RETRYABLE if include_defaults else ()) + nr
        self.retryable = rt
        #: DB-API and SQLAlchemy IntegrityError, DataError, ProgrammingError, NotSupportedError (any driver's):
        #: a constraint violation or bad SQL fails the same way on every attempt. OperationalError (the
        #: database down, a deadlock, a serialization failure) stays retryable.
        self.database_defaults = include_defaults
        #: Each exception class's answer (:meth:`_class_verdict`), kept while the rules are these.
        self._rules: tuple[object, ...] = (self.not_retryable, self.retryable, self.database_defaults)
        self._by_class: dict[type, bool | None | object] = {}

    def is_retryable(self, exc: BaseException) -> bool:
        """True unless ``exc`` or anything on its cause chain is classified not retryable.

        A typed listener's :class:`~kafkatx.DecodeError` is never retryable, whatever the lists say:
        the same bytes cannot decode next time, and its record never reached the handler.
        """
        if isinstance(exc, DecodeError):
            return False
        rules = (self.not_retryable, self.retryable, self.database_defaults)
        if self._rules is not rules and self._rules != rules:  # the lists were changed: answers kept go
            self._rules, self._by_class = rules, {}
        by_class = self._by_class
        for link in cause_chain(exc):
            cls = type(link)
            verdict = by_class.get(cls, _UNDECIDED)
            if verdict is _UNDECIDED:
                verdict = by_class[cls] = self._class_verdict(cls)
            if verdict is not None:
                return bool(verdict)
        return True

    def _class_verdict(self, cls: type) -> bool | None:
        """What a link of class ``cls`` says: retryable (True), not (False), or nothing (None: the next link)."""
        nr = _closest(cls, self.not_retryable)
        if nr is None and self.database_defaults:
            nr = permanent_database_error_class(cls)
        rt = _closest(cls, self.retryable)
        if nr is None and rt is None:
            return None
        if rt is None:
            return False
        if nr is None:
            return True
        return cls.__mro__.index(rt) <= cls.__mro__.index(nr)


#: No answer kept yet for a class.
_UNDECIDED = object()


def _closest(cls: type, candidates: tuple[type[BaseException], ...]) -> type | None:
    for base in cls.__mro__:
        if base in candidates:
            return base
    return None


class retry_if_retryable(retry_base):  # noqa: N801 - named like tenacity's own retry strategies
    """A tenacity retry strategy that asks an :class:`ExceptionClassifier`.

    It composes with tenacity's others (``retry_if_retryable(c) & retry_if_exception_type(IOError)``).
    """

    def __init__(self, classifier: ExceptionClassifier) -> None:
        self.classifier = classifier

    def __call__(self, retry_state: RetryCallState) -> bool:
        outcome = retry_state.outcome
        if outcome is None or not outcome.failed:
            return False
        exc = outcome.exception()
        return exc is not None and self.classifier.is_retryable(exc)
