"""The rules of /livez and /readyz (kafkatx.health), over plain states and fakes: no broker."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from kafkatx import InvalidConfigurationError
from kafkatx.client.bounded import CallInProgress
from kafkatx.health.checks import ContainerState, ListenerState, check_health_options, liveness, readiness
from kafkatx.health.server import HealthServer, app_routes
from kafkatx.health.snapshot import listener_states
from kafkatx.health.workers import WorkerState, read_port_file, workers_liveness, workers_readiness
from kafkatx.listener.failure.outage import ListenerOutage
from kafkatx.listener.loop.brokers import BrokerWatch

READY = ContainerState("orders", "running", opened=True, assignment_received=True, partitions=3)


def _one(*containers: ContainerState, held_for: float | None = None) -> list[ListenerState]:
    return [ListenerState("orders", tuple(containers), held_for)]


# -- liveness -------------------------------------------------------------------------------------
def test_running_containers_are_live_and_a_stopped_one_is_not_with_its_failure_named() -> None:
    assert liveness(_one(READY)).ok
    failed = ContainerState("orders#1", "stopped", opened=True, failure="SystemExit: 3")
    verdict = liveness(_one(READY, failed))
    assert not verdict.ok and verdict.status == 503
    rows = verdict.body["listeners"][0]["containers"]
    assert rows[1] == {"container": "orders#1", "live": False, "reason": "stopped by SystemExit: 3"}
    assert verdict.body["status"] == "not live"


def test_before_start_the_app_is_live_but_not_ready() -> None:
    assert liveness(_one()).ok and liveness(_one()).body["status"] == "starting"
    verdict = readiness(_one())
    assert not verdict.ok and verdict.body["listeners"][0]["reasons"] == ["not started"]


def test_a_client_call_is_tolerated_until_well_past_its_deadline() -> None:
    within = ContainerState(
        "orders", "running", opened=True, blocked_call="commit", blocked_for=40, blocked_deadline=20
    )
    assert liveness(_one(within), grace=30).ok
    stuck = ContainerState("orders", "running", opened=True, blocked_call="commit", blocked_for=51, blocked_deadline=20)
    verdict = liveness(_one(stuck), grace=30)
    assert not verdict.ok
    assert "blocked in commit for 51s" in verdict.body["listeners"][0]["containers"][0]["reason"]


def test_a_bounded_call_in_progress_carries_its_deadline() -> None:
    from kafkatx.client.bounded import BoundedCaller

    caller = BoundedCaller("p")
    seen: list[CallInProgress | None] = []
    caller.call("commit_transaction", lambda: seen.append(caller.current), 7.5)
    call = seen[0]
    assert call is not None and (call.operation, call.deadline) == ("commit_transaction", 7.5)
    assert caller.current is None, "a call that returned is still reported"
    caller.close()


def test_a_consume_that_does_not_return_long_after_its_timeout_is_not_live() -> None:
    polling = ContainerState("orders", "running", opened=True, since_poll=20.0, poll_deadline=0.6)
    assert liveness(_one(polling), grace=30).ok, "within the grace"
    stuck = ContainerState("orders", "running", opened=True, since_poll=31.0, poll_deadline=0.6)
    verdict = liveness(_one(stuck), grace=30)
    assert not verdict.ok
    assert "has not returned from consume() for 31s" in verdict.body["listeners"][0]["containers"][0]["reason"]
    bounded = ContainerState(
        "orders", "running", opened=True, since_poll=31.0, blocked_call="commit", blocked_for=5, blocked_deadline=20
    )
    assert liveness(_one(bounded), grace=30).ok, "inside consume(), a bounded call within its deadline decides"


def test_the_snapshot_times_consume_only_between_batches() -> None:
    spec = _Spec("orders", max_batch_ms=2000)
    c = _Container("orders", spec, thread=threading.current_thread(), polled_at=100.0)
    c.started.set()
    app = _App([spec], [c], {"orders": ListenerOutage("orders", lambda event: None)})
    [state] = listener_states(app)[0].containers
    assert state.since_poll is not None and state.since_poll > 0 and state.poll_deadline == 2.5
    c.handling_since = time.monotonic()
    assert listener_states(app)[0].containers[0].since_poll is None, "a handler taking long is not a stuck poll"
    c.handling_since, c.started = None, threading.Event()
    assert listener_states(app)[0].containers[0].since_poll is None, "not before the consumer is open"


def test_a_slow_handler_never_makes_a_container_not_live() -> None:
    slow = ContainerState("orders", "running", opened=True, assignment_received=True, handling_for=3600.0)
    assert liveness(_one(slow)).ok
    assert not readiness(_one(slow), not_ready_after=60).ok


# -- readiness ------------------------------------------------------------------------------------
def test_ready_only_once_the_assignment_arrived_and_an_empty_one_counts() -> None:
    waiting = ContainerState("orders", "running", opened=True)
    verdict = readiness(_one(waiting))
    assert not verdict.ok
    assert (
        verdict.body["listeners"][0]["containers"][0]["reason"]
        == "waiting for its partition assignment from the group (and its partitions' producers)"
    )
    spare = ContainerState("orders#1", "running", opened=True, assignment_received=True, partitions=0)
    verdict = readiness(_one(READY, spare))
    assert verdict.ok and verdict.status == 200
    assert [c["partitions"] for c in verdict.body["listeners"][0]["containers"]] == [3, 0]


def test_a_batch_handled_longer_than_the_bound_makes_the_listener_not_ready() -> None:
    busy = ContainerState("orders", "running", opened=True, assignment_received=True, handling_for=5.0)
    assert readiness(_one(busy), not_ready_after=10).ok
    verdict = readiness(_one(busy), not_ready_after=2)
    assert not verdict.ok
    assert "handling one batch for 5s" in verdict.body["listeners"][0]["reasons"][0]


def test_a_stalled_partition_makes_the_listener_not_ready() -> None:
    stalled = ContainerState("orders", "running", opened=True, assignment_received=True, stalled=("orders[2]",))
    verdict = readiness(_one(stalled))
    assert not verdict.ok and "orders[2]" in verdict.body["listeners"][0]["reasons"][0]


def test_a_pause_is_fine_until_it_lasts_longer_than_the_bound() -> None:
    assert readiness(_one(READY, held_for=0.5), not_ready_after=1).ok
    verdict = readiness(_one(READY, held_for=1.5), not_ready_after=1)
    assert not verdict.ok
    assert verdict.body["listeners"][0]["paused_for"] == 1.5
    assert "paused for 2s" in verdict.body["listeners"][0]["reasons"][0]


def test_the_body_names_the_listener_that_is_not_ready() -> None:
    states = [
        ListenerState("orders", (READY,)),
        ListenerState("payments", (ContainerState("payments", "running", opened=True),)),
    ]
    verdict = readiness(states)
    assert [(entry["listener"], entry["ready"]) for entry in verdict.body["listeners"]] == [
        ("orders", True),
        ("payments", False),
    ]


@pytest.mark.parametrize(
    ("port", "addr", "bound", "named"),
    [
        (70000, "127.0.0.1", 60.0, "health_port"),
        (True, "127.0.0.1", 60.0, "health_port"),
        (None, "", 60.0, "health_addr"),
        (None, "127.0.0.1", 0, "not_ready_after"),
        (None, "127.0.0.1", float("inf"), "not_ready_after"),
        (None, "127.0.0.1", True, "not_ready_after"),
    ],
)
def test_bad_health_options_are_refused_by_name(port: Any, addr: Any, bound: Any, named: str) -> None:
    with pytest.raises(InvalidConfigurationError, match=named):
        check_health_options(port, addr, bound)


def test_the_app_refuses_a_bad_bound_when_declared() -> None:
    from kafkatx import App

    with pytest.raises(InvalidConfigurationError, match="not_ready_after"):
        App("orders", not_ready_after=-1)


# -- snapshots of an App, through fakes -------------------------------------------------------------
@dataclass
class _Spec:
    name: str
    max_batch_ms: int = 100


@dataclass
class _Container:
    name: str
    spec: _Spec
    thread: threading.Thread | None = None
    started: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None
    assignment_received: threading.Event = field(default_factory=threading.Event)
    assignment: set[tuple[str, int]] = field(default_factory=set)
    handling_since: float | None = None
    stalled_partitions: frozenset[tuple[str, int]] = frozenset()
    stalled_retry_partitions: frozenset[tuple[str, int]] = frozenset()
    call: CallInProgress | None = None
    polled_at: float = field(default_factory=time.monotonic)
    brokers: BrokerWatch = field(default_factory=lambda: BrokerWatch("c", 0, "127.0.0.1:9092"))

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def blocked_call(self) -> CallInProgress | None:
        return self.call


@dataclass
class _App:
    listeners: list[_Spec]
    containers: list[_Container]
    outages: dict[str, ListenerOutage]
    not_ready_after: float = 60.0
    name: str = "app"

    def listener_outage(self, listener: str) -> ListenerOutage:
        return self.outages[listener]


def test_snapshot_reads_each_container_and_the_listeners_pause() -> None:
    clock = [100.0]
    outage = ListenerOutage("orders", lambda event: None, clock=lambda: clock[0])
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    spec = _Spec("orders")
    running, stopped = _Container("orders#0", spec), _Container("orders#1", spec, thread=ended)
    running.thread = threading.current_thread()
    running.started.set()
    running.assignment_received.set()
    running.assignment = {("orders", 0), ("orders", 1)}
    running.stalled_partitions = frozenset({("orders", 1)})
    running.call = CallInProgress("commit_transaction", 12.0)
    stopped.failure = SystemExit(3)
    app = _App([spec], [running, stopped], {"orders": outage})
    outage.pause()
    clock[0] += 7.5
    [state] = listener_states(app)
    assert state.held_for == 7.5
    first, second = state.containers
    assert (first.thread, first.partitions, first.stalled, first.blocked_call, first.blocked_deadline) == (
        "running",
        2,
        ("orders[1]",),
        "commit_transaction",
        12.0,
    )
    assert (second.thread, second.failure) == ("stopped", "SystemExit: 3")
    outage.resume()
    assert listener_states(app)[0].held_for is None


def test_an_outage_and_an_operators_pause_are_held_since_the_earlier_one() -> None:
    clock = [0.0]
    outage = ListenerOutage("orders", lambda event: None, clock=lambda: clock[0])
    outage.report(0, ConnectionError("db down"), None)
    clock[0] = 5.0
    outage.pause()
    clock[0] = 8.0
    assert outage.held_for() == 8.0


# -- the endpoint -------------------------------------------------------------------------------------
def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_endpoint_answers_200_or_503_with_the_json_body() -> None:
    spec = _Spec("orders")
    container = _Container("orders", spec, thread=threading.current_thread())
    container.started.set()
    app = _App([spec], [container], {"orders": ListenerOutage("orders", lambda event: None)})
    with HealthServer(app_routes(app), 0) as server:
        assert server.port > 0
        assert _get(server.url + "/livez")[0] == 200
        status, body = _get(server.url + "/readyz")
        assert status == 503 and body["listeners"][0]["ready"] is False
        container.assignment_received.set()
        assert _get(server.url + "/readyz") == (
            200,
            {
                "status": "ready",
                "listeners": [
                    {
                        "listener": "orders",
                        "ready": True,
                        "containers": [{"container": "orders", "ready": True, "partitions": 0}],
                    }
                ],
            },
        )
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url + "/nope", timeout=5)
        assert missing.value.code == 404


def test_an_ipv6_address_is_served_too() -> None:
    try:
        server = HealthServer({"/livez": lambda: (200, "text/plain", b"ok")}, 0, "::1")
    except InvalidConfigurationError:
        pytest.skip("no IPv6 loopback here")
    with server:
        assert server.url.startswith("http://[::1]:")
        with urllib.request.urlopen(server.url + "/livez", timeout=5) as response:
            assert response.read() == b"ok"


def test_a_port_in_use_is_a_configuration_error_naming_it() -> None:
    with HealthServer({}, 0) as first:
        with pytest.raises(InvalidConfigurationError, match=f"127.0.0.1:{first.port}"):
            HealthServer({}, first.port)


# -- the supervisor's view of its workers -------------------------------------------------------------
def _probe(answers: dict[tuple[int, str], tuple[int | None, Any]]) -> Any:
    return lambda port, path: answers.get((port, path), (None, None))


def test_workers_are_live_while_running_or_restarting_and_not_once_one_says_it_is_not() -> None:
    workers = [WorkerState("w-0", "running", 1001), WorkerState("w-1", "restarting")]
    assert workers_liveness(workers, _probe({(1001, "/livez"): (200, {"status": "live"})})).ok
    assert workers_liveness([WorkerState("w-0", "running", None)], _probe({})).ok  # not reported yet: starting
    verdict = workers_liveness(workers, _probe({(1001, "/livez"): (503, {"status": "not live"})}))
    assert not verdict.ok and verdict.body["workers"][0]["health"] == {"status": "not live"}
    assert not workers_liveness([WorkerState("w-0", "stopped")], _probe({})).ok


def test_workers_are_ready_when_every_one_says_so() -> None:
    answers = {(1001, "/readyz"): (200, {"status": "ready"}), (1002, "/readyz"): (200, {"status": "ready"})}
    both = [WorkerState("w-0", "running", 1001), WorkerState("w-1", "running", 1002)]
    assert workers_readiness(both, _probe(answers)).ok
    verdict = workers_readiness([both[0], WorkerState("w-1", "restarting")], _probe(answers))
    assert not verdict.ok
    assert [(w["worker"], w["ready"]) for w in verdict.body["workers"]] == [("w-0", True), ("w-1", False)]
    assert not workers_readiness([WorkerState("w-0", "running", None)], _probe(answers)).ok


def test_a_port_file_that_is_missing_or_garbled_reads_as_no_port(tmp_path: Any) -> None:
    path = tmp_path / "w-0.health-port"
    assert read_port_file(str(path)) is None
    path.write_text("x")
    assert read_port_file(str(path)) is None
    path.write_text("4711")
    assert read_port_file(str(path)) == 4711
