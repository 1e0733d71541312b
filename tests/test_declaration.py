"""Listener declarations: typed options, checked when the decorator runs (no broker needed)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest

from kafkatx import App, DefaultAfterRollbackProcessor, InvalidConfigurationError, KafkaTxError, Record
from kafkatx.listener.options import LISTENER_DEFAULTS, ListenerOptions
from kafkatx.listener.spec import build_spec


def app() -> App:
    return App("decl", bootstrap_servers="127.0.0.1:9")


def handle(record: Record) -> bytes | None:
    return record.value


def test_a_misspelt_option_suggests_the_closest_name() -> None:
    with pytest.raises(InvalidConfigurationError, match=r"unknown option 'max_attempt'; did you mean 'max_attempts'\?"):
        app().listener("in", max_attempt=3)(handle)  # type: ignore[call-arg]
    with pytest.raises(InvalidConfigurationError, match=r"unknown option 'zzz'; valid options: "):
        app().add_listener(handle, "in", zzz=1)  # type: ignore[call-arg]


def test_a_misspelt_app_option_suggests_the_closest_name_like_a_listener_option() -> None:
    """From Python too, not only under `kafkatx run`: Python's own TypeError named neither."""
    with pytest.raises(
        InvalidConfigurationError,
        match=r"App\(\) got an unknown option 'bootstrap_server'; "
        r"did you mean 'bootstrap_servers'\?",
    ):
        App("decl", bootstrap_server="127.0.0.1:9")  # type: ignore[call-arg]
    with pytest.raises(InvalidConfigurationError, match=r"unknown option 'zzz'; valid options: .*create_topics"):
        App("decl", zzz=1)  # type: ignore[call-arg]
    assert App(name="decl", create_topics=True).create_topics, "every real option, the name too, is still taken"


def test_every_error_raised_at_declaration_is_a_kafkatx_error() -> None:
    with pytest.raises(KafkaTxError):
        app().listener("in", fencing="nope")(handle)  # type: ignore[arg-type]


def test_the_signatures_list_every_option_with_its_default() -> None:
    for method in (App.listener, App.add_listener):
        params = inspect.signature(method).parameters
        assert set(ListenerOptions.__annotations__) <= set(params)
        assert params["max_attempts"].default == 3 and params["max_attempts"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["fencing"].default == "auto"
    assert set(LISTENER_DEFAULTS) == set(ListenerOptions.__annotations__)
    assert inspect.signature(App.spark_listener).parameters["max_batch_records"].default == 50_000


def test_a_handler_that_cannot_take_a_record_is_rejected_when_declared() -> None:
    def no_args() -> None: ...

    def two_args(record: Record, other: int) -> None: ...

    for bad in (no_args, two_args):
        with pytest.raises(InvalidConfigurationError, match="cannot be called with one Record"):
            app().listener("in")(bad)
    app().listener("in")(lambda record, extra=None: None)  # optional extras are fine
    app().listener("in")(print)  # builtins have no signature to check


def test_policy_options_in_two_places_are_rejected() -> None:
    processor = DefaultAfterRollbackProcessor(max_attempts=5)
    with pytest.raises(
        InvalidConfigurationError, match="max_attempts given both on the listener and through after_rollback"
    ):
        app().listener("in", after_rollback=processor, max_attempts=2)(handle)
    spec = app().add_listener(handle, "in", after_rollback=processor, retry="in_place")
    assert spec.policy is processor.policy, "in-place retries follow the processor's policy"


def test_in_place_retries_cannot_follow_a_custom_processor() -> None:
    class Custom:
        def process(self, context: object) -> None: ...

    with pytest.raises(InvalidConfigurationError, match='retry="in_place" cannot follow a custom after_rollback'):
        app().listener("in", after_rollback=Custom(), retry="in_place")(handle)
    app().listener("in", after_rollback=Custom())(handle)  # the rollback path calls it


def test_two_containers_exiting_together_both_count_as_stopped() -> None:
    """11.7 (deterministic): App.run waited on liveness; two containers exiting at once each saw the
    other still alive, so nobody declared the App stopped and run() never returned."""

    class Exiting:
        failure = None
        alive = True  # both threads are still inside their exit path
        thread = None
        stop_reason = "normal"
        group_id = "g"
        consumer_config: dict[str, str] = {}  # dynamic membership: no group to leave on the way out

        def __init__(self, name: str) -> None:
            self.name = name

        def join(self, timeout: float | None = None) -> bool:
            return not self.alive

    a = app()
    first, second = Exiting("a"), Exiting("b")
    a.containers = [first, second]  # type: ignore[list-item]
    a._exited = set()
    a.container_exited(first)  # type: ignore[arg-type]
    assert not a._stopped.is_set(), "one of two has stopped"
    a.container_exited(second)  # type: ignore[arg-type]
    assert a._stopped.is_set(), "both have stopped, though their threads have not ended yet (what run() waits for)"
    assert not a.wait(0), "wait() also waits for the threads to end"
    first.alive = second.alive = False
    assert a.wait(0)


def test_an_async_handler_is_refused_where_it_would_not_be_awaited() -> None:
    """Issue 29 item 3: accepted, it failed every record (dead-lettered, or skipped with an ERROR line)."""

    async def enrich(record: Record) -> bytes | None:
        return record.value

    async def stream(record: Record) -> Any:
        yield record.value

    class Handler:
        async def __call__(self, record: Record) -> bytes | None:
            return record.value

    with pytest.raises(InvalidConfigurationError, match=r"async generator.*declare it def"):
        app().listener("in")(stream)
    for handler in (Handler(), functools.partial(enrich)):
        with pytest.raises(InvalidConfigurationError, match=r"async def"):
            build_spec(handler, ["in"], {}, kind="batch", runner=lambda container: lambda unit: None)


def test_concurrency_options_are_refused_on_spark_listeners() -> None:
    for option in ("in_flight", "ordering"):
        with pytest.raises(InvalidConfigurationError, match=rf"spark_listener does not take {option!r}: a Spark job"):
            app().spark_listener("in", **{option: 4})  # type: ignore[arg-type]


def test_retry_in_place_is_deprecated_with_a_warning_pointing_at_the_declaration() -> None:
    """Since precise rollback the default retries inside the transaction too: in_place warns, and still works."""
    with pytest.warns(DeprecationWarning, match=r'retry="in_place" is deprecated') as caught:
        app().listener("in", retry="in_place")(handle)
    assert caught[0].filename == __file__, "the warning names the user's line, not kafkatx's"
