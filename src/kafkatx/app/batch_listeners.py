"""``app.batch_listener`` and ``app.add_batch_listener``: the App's declarations of batch listeners (docs/BATCH.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from kafkatx.errors import InvalidConfigurationError
from kafkatx.listener.failure.poison_isolation import DEFAULT_MAX_BISECT_JOBS
from kafkatx.listener.options import LISTENER_DEFAULTS, BatchListenerOptions, signature_with_options
from kafkatx.listener.runners.batch_declaration import batch_listener_spec

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["BatchListeners"]

F = TypeVar("F", bound=Callable[..., Any])


class BatchListeners:
    """The App's batch-listener declarations (a part of :class:`~kafkatx.App`, which registers the specs)."""

    if TYPE_CHECKING:

        def register(self, spec: ListenerSpec) -> ListenerSpec: ...

    def batch_listener(self, *topics: str, **options: Unpack[BatchListenerOptions]) -> Callable[[F], F]:
        """Declare a handler of record batches: ``@app.batch_listener("orders", output="scored")``.

        The handler (a function, or an ``async def``) takes a ``list[Record]`` (a poll's records, at most
        ``max_batch_records``) and returns what a record handler may return, or an iterable of it; ``send()``
        works inside. The batch's outputs and offsets commit in one transaction. ``raise
        kafkatx.RecordFailedError(record) from err`` names the record that failed; any other exception fails
        the call, which is retried, then searched by halves for the records that fail on their own (only they
        are recovered). Options: those of ``app.listener`` that apply to a batch, plus ``max_bisect_jobs``
        [128]; see docs/BATCH.md.
        """
        if len(topics) == 1 and callable(topics[0]) and not isinstance(topics[0], str):
            raise InvalidConfigurationError("use @app.batch_listener('topic', ...) with at least one topic name")

        def decorator(handler: F) -> F:
            self.add_batch_listener(handler, *topics, **options)
            return handler

        return decorator

    def add_batch_listener(
        self, handler: Callable[..., Any], *topics: str, **options: Unpack[BatchListenerOptions]
    ) -> ListenerSpec:
        """The non-decorator form of :meth:`batch_listener`."""
        return self.register(batch_listener_spec(handler, topics, options))


# help(app.batch_listener) and editors that read signatures show every option with its default.
_DEFAULTS = {**LISTENER_DEFAULTS, "max_bisect_jobs": DEFAULT_MAX_BISECT_JOBS}
BatchListeners.batch_listener.__signature__ = signature_with_options(  # type: ignore[attr-defined]
    BatchListeners.batch_listener, BatchListenerOptions, _DEFAULTS
)
BatchListeners.add_batch_listener.__signature__ = signature_with_options(  # type: ignore[attr-defined]
    BatchListeners.add_batch_listener, BatchListenerOptions, _DEFAULTS
)
