"""A batch listener's declaration: its options checked (those that do not apply to a batch refused, each with
its reason), then a spec whose runner is the batch runner (:mod:`kafkatx.listener.runners.batch_runner`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kafkatx._validate import is_int
from kafkatx.errors import InvalidConfigurationError
from kafkatx.listener.failure.poison_isolation import DEFAULT_MAX_BISECT_JOBS
from kafkatx.listener.host import ContainerHost
from kafkatx.listener.options import BatchListenerOptions, check_option_names
from kafkatx.listener.runners.batch_runner import BatchRunner
from kafkatx.listener.spec import ListenerSpec, build_spec, is_async_handler

__all__ = ["NOT_FOR_BATCH", "batch_listener_spec"]

#: Listener options a batch listener refuses, and why.
NOT_FOR_BATCH = {
    "after_rollback": "a batch listener settles failures itself (a named record alone, poison isolated by halves)",
    "retry": "a batch listener retries a failed call in its transaction or after the back-off; there is no in_place",
    "in_flight": "a batch listener gets the whole batch in one call (in_flight= is for record listeners)",
    "ordering": "a batch listener gets the whole batch in one call, in order (ordering= is for record listeners)",
    "overlap_commit": "a batch listener's call runs inside its transaction (overlap_commit= is for record listeners)",
}


def batch_listener_spec(handler: Callable[..., Any], topics: Iterable[str], options: Mapping[str, Any]) -> ListenerSpec:
    """Check ``options`` (:class:`~kafkatx.listener.options.BatchListenerOptions`) and build the spec."""
    topics = tuple(topics)
    if not topics or (len(topics) == 1 and callable(topics[0]) and not isinstance(topics[0], str)):
        raise InvalidConfigurationError("use @app.batch_listener('topic', ...) with at least one topic name")
    opts = dict(options)
    for key, why in NOT_FOR_BATCH.items():
        if key in opts:
            raise InvalidConfigurationError(f"batch_listener does not take {key!r}: {why}")
    check_option_names(opts, BatchListenerOptions.__annotations__, "batch_listener")
    max_bisect_jobs = opts.pop("max_bisect_jobs", DEFAULT_MAX_BISECT_JOBS)
    if not is_int(max_bisect_jobs, 0):
        raise InvalidConfigurationError(f"max_bisect_jobs must be an integer >= 0, got {max_bisect_jobs!r}")
    if opts.get("database") is not None and is_async_handler(handler):
        raise InvalidConfigurationError(
            "batch_listener: database= needs a def handler (the database transaction is the container thread's, "
            "and db() is bound to that thread): make the handler a plain def"
        )
    if not callable(handler):
        raise InvalidConfigurationError(
            f"a batch listener handler must be callable (list[Record] -> iterable of outputs or None), got {handler!r}"
        )

    def runner(container: ContainerHost) -> BatchRunner:
        return BatchRunner(spec, container, max_bisect_jobs)

    spec = build_spec(handler, topics, opts, kind="batch", runner=runner, where="batch_listener", records_handler=True)
    return spec
