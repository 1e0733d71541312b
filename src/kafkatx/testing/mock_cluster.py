"""Fault injection through librdkafka's built-in mock cluster.

:class:`MockCluster` binds, through :mod:`ctypes`, the mock-cluster C API
(``rdkafka_mock.h``) of the librdkafka that ships inside the confluent-kafka
wheel. The mock brokers speak the Kafka protocol on localhost, so ordinary
``confluent_kafka`` clients connect to :attr:`MockCluster.bootstrap_servers`
and see exactly the errors a test pushes onto the mock's error stacks.

Use it only to check how code reacts to broker errors, fenced producers and
unavailable brokers. The mock is not a faithful broker: it does not honour
``isolation.level=read_committed``, producer fencing or transactional offset
commits, so exactly-once semantics must be tested against a real broker.

The mock API is marked experimental in librdkafka and has no ABI guarantee;
kafkatx pins confluent-kafka exactly because of this module.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from kafkatx._validate import is_int

__all__ = ["ApiKey", "MockCluster", "MockClusterError", "MockRequest"]


class MockClusterError(RuntimeError):
    """The mock cluster could not be loaded, created or used."""


class ApiKey(enum.IntEnum):
    """Kafka protocol request types, for choosing which requests fail."""

    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    OFFSET_COMMIT = 8
    OFFSET_FETCH = 9
    FIND_COORDINATOR = 10
    JOIN_GROUP = 11
    HEARTBEAT = 12
    LEAVE_GROUP = 13
    SYNC_GROUP = 14
    INIT_PRODUCER_ID = 22
    ADD_PARTITIONS_TO_TXN = 24
    ADD_OFFSETS_TO_TXN = 25
    END_TXN = 26
    TXN_OFFSET_COMMIT = 28


class MockRequest(NamedTuple):
    """One request the mock cluster received while tracking was on."""

    broker_id: int
    api_key: ApiKey | int  # an ApiKey when kafkatx knows the request type
    timestamp_us: int


# --------------------------------------------------------------------------
# Library loading and binding (private)
# --------------------------------------------------------------------------

_RD_KAFKA_PRODUCER = 0
_RD_KAFKA_CONF_OK = 0
_ERRSTR_SIZE = 512
_INT16_MAX = 0x7FFF
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1

_p = ctypes.c_void_p
_size_t = ctypes.c_size_t
_int16 = ctypes.c_int16
_int32 = ctypes.c_int32
_err_t = ctypes.c_int  # rd_kafka_resp_err_t is a C enum

# name -> (restype, argtypes). Every function we call is listed here so that
# ctypes never guesses an int return for a pointer or truncates an argument.
_REQUIRED: dict[str, tuple[Any, list[Any]]] = {
    "rd_kafka_conf_new": (_p, []),
    "rd_kafka_conf_set": (ctypes.c_int, [_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, _size_t]),
    "rd_kafka_conf_destroy": (None, [_p]),
    "rd_kafka_new": (_p, [ctypes.c_int, _p, ctypes.c_char_p, _size_t]),
    "rd_kafka_destroy": (None, [_p]),
    "rd_kafka_mock_cluster_new": (_p, [_p, ctypes.c_int]),
    "rd_kafka_mock_cluster_bootstraps": (ctypes.c_char_p, [_p]),
    "rd_kafka_mock_cluster_destroy": (None, [_p]),
    "rd_kafka_mock_topic_create": (_err_t, [_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
    "rd_kafka_mock_push_request_errors_array": (None, [_p, _int16, _size_t, ctypes.POINTER(_err_t)]),
    "rd_kafka_mock_clear_request_errors": (None, [_p, _int16]),
    "rd_kafka_mock_broker_set_down": (_err_t, [_p, _int32]),
    "rd_kafka_mock_broker_set_up": (_err_t, [_p, _int32]),
    "rd_kafka_mock_group_initial_rebalance_delay_ms": (None, [_p, _int32]),
}

# Bound when present; the methods that need them raise MockClusterError if not.
_OPTIONAL: dict[str, tuple[Any, list[Any]]] = {
    # Variadic: the fixed part is declared; (err, rtt_ms) pairs follow as c_int.
    "rd_kafka_mock_broker_push_request_error_rtts": (_err_t, [_p, _int32, _int16, _size_t]),
    "rd_kafka_mock_start_request_tracking": (None, [_p]),
    "rd_kafka_mock_stop_request_tracking": (None, [_p]),
    "rd_kafka_mock_clear_requests": (None, [_p]),
    "rd_kafka_mock_get_requests": (ctypes.POINTER(_p), [_p, ctypes.POINTER(_size_t)]),
    "rd_kafka_mock_request_id": (_int32, [_p]),
    "rd_kafka_mock_request_api_key": (_int16, [_p]),
    "rd_kafka_mock_request_timestamp": (ctypes.c_int64, [_p]),
    "rd_kafka_mock_request_destroy_array": (None, [ctypes.POINTER(_p), _size_t]),
}

_TRACKING = (
    "rd_kafka_mock_start_request_tracking",
    "rd_kafka_mock_stop_request_tracking",
    "rd_kafka_mock_clear_requests",
    "rd_kafka_mock_get_requests",
    "rd_kafka_mock_request_id",
    "rd_kafka_mock_request_api_key",
    "rd_kafka_mock_request_timestamp",
    "rd_kafka_mock_request_destroy_array",
)

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _find_library() -> Path:
    """Locate the librdkafka bundled with the installed confluent-kafka wheel.

    We must use that copy (not a system librdkafka) so the mock cluster has
    the same version as the clients under test.
    """
    try:
        import confluent_kafka
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise MockClusterError("MockCluster needs confluent-kafka, which is not importable") from exc
    package_dir = Path(confluent_kafka.__file__).resolve().parent
    site_dir = package_dir.parent
    patterns = [
        (site_dir / "confluent_kafka.libs", "librdkafka-*.so*"),  # Linux (auditwheel)
        (package_dir / ".dylibs", "librdkafka*.dylib"),  # macOS (delocate)
        (site_dir / "confluent_kafka.libs", "librdkafka*.dll"),  # Windows (delvewheel)
    ]
    tried = []
    for directory, pattern in patterns:
        matches = sorted(directory.glob(pattern))
        if matches:
            return matches[0]
        tried.append(str(directory / pattern))
    raise MockClusterError(
        "cannot find the librdkafka bundled with confluent-kafka "
        f"{getattr(confluent_kafka, '__version__', '?')}; looked for: {', '.join(tried)}"
    )


def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
    func = getattr(lib, name)
    func.restype = restype
    func.argtypes = argtypes
    return func


def _load() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = _find_library()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise MockClusterError(f"cannot load {path}: {exc}") from exc
        for name, (restype, argtypes) in _REQUIRED.items():
            try:
                _bind(lib, name, restype, argtypes)
            except AttributeError:
                raise MockClusterError(
                    f"{path.name} has no function {name}; the librdkafka mock API changed "
                    "(is confluent-kafka the version kafkatx pins?)"
                ) from None
        for name, (restype, argtypes) in _OPTIONAL.items():
            try:
                _bind(lib, name, restype, argtypes)
            except AttributeError:
                pass
        _lib = lib
        return lib


def _has(lib: ctypes.CDLL, name: str) -> bool:
    try:
        getattr(lib, name)
    except AttributeError:
        return False
    return True


def _err_name(code: int) -> str:
    try:
        from confluent_kafka import KafkaError

        return f"{KafkaError(code).name()} ({code})"
    except Exception:  # pragma: no cover - name lookup is cosmetic
        return str(code)


def _api_key(api_key: ApiKey | int) -> int:
    if not is_int(api_key):
        raise ValueError(f"api_key must be an ApiKey or an int, not {type(api_key).__name__}")
    if not 0 <= api_key <= _INT16_MAX:
        raise ValueError(f"api_key must be between 0 and {_INT16_MAX}, got {api_key}")
    return int(api_key)


def _error_code(error: Any) -> int:
    code = error.code() if hasattr(error, "code") and callable(error.code) else error
    if not is_int(code):
        raise ValueError(f"errors must be KafkaError codes (int), not {type(error).__name__}")
    return int(code)


def _checked_int32(value: int, what: str) -> int:
    if not is_int(value):
        raise ValueError(f"{what} must be an int, not {type(value).__name__}")
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"{what} out of range: {value}")
    return value


# --------------------------------------------------------------------------
# Public class
# --------------------------------------------------------------------------


class MockCluster:
    """An in-process librdkafka mock Kafka cluster for fault-injection tests.

    It creates its own private librdkafka handle to host the mock brokers, so
    the clients under test stay ordinary clients configured with
    ``bootstrap.servers=cluster.bootstrap_servers``. Close it (or use it as a
    context manager) to stop the brokers; clients still connected afterwards
    only log connection errors.

    Not a real broker: read_committed, fencing and transactional offset
    commits are not enforced, so use it for error paths only.
    """

    def __init__(self, brokers: int = 1, *, initial_rebalance_delay_ms: int | None = 0) -> None:
        """Start ``brokers`` mock brokers on localhost.

        ``initial_rebalance_delay_ms`` defaults to 0 rather than the mock's
        3 s so that the first consumer-group join does not stall tests;
        ``None`` keeps librdkafka's default.
        """
        self._rk: int | None = None
        self._mcluster: int | None = None
        self._lock = threading.RLock()
        if not is_int(brokers, 1):
            raise ValueError(f"brokers must be an int >= 1, got {brokers!r}")
        if initial_rebalance_delay_ms is not None:
            initial_rebalance_delay_ms = _checked_int32(initial_rebalance_delay_ms, "initial_rebalance_delay_ms")
            if initial_rebalance_delay_ms < 0:
                raise ValueError(f"initial_rebalance_delay_ms must be >= 0, got {initial_rebalance_delay_ms}")

        lib = self._lib = _load()
        self._rk = self._new_handle(lib)
        mcluster = lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        if not mcluster:
            lib.rd_kafka_destroy(self._rk)
            self._rk = None
            raise MockClusterError(f"rd_kafka_mock_cluster_new failed to start {brokers} mock broker(s)")
        self._mcluster = mcluster
        self._brokers = brokers
        raw = lib.rd_kafka_mock_cluster_bootstraps(mcluster)
        self._bootstrap_servers = raw.decode() if raw else ""
        if initial_rebalance_delay_ms is not None:
            self.set_initial_rebalance_delay(initial_rebalance_delay_ms)

    @staticmethod
    def _new_handle(lib: ctypes.CDLL) -> int:
        # The mock cluster must be owned by an rd_kafka_t; a producer that
        # never produces is the cheapest one.
        errstr = ctypes.create_string_buffer(_ERRSTR_SIZE)
        conf = lib.rd_kafka_conf_new()
        if not conf:
            raise MockClusterError("rd_kafka_conf_new failed")
        # log_level 4 hides the NOTICE that this handle has no bootstrap.servers.
        settings = {"client.id": "kafkatx-mock-cluster", "log_level": "4"}
        for key, value in settings.items():
            res = lib.rd_kafka_conf_set(conf, key.encode(), value.encode(), errstr, _ERRSTR_SIZE)
            if res != _RD_KAFKA_CONF_OK:
                lib.rd_kafka_conf_destroy(conf)
                detail = errstr.value.decode(errors="replace")
                raise MockClusterError(f"rd_kafka_conf_set({key}={value}) failed: {detail}")
        rk = lib.rd_kafka_new(_RD_KAFKA_PRODUCER, conf, errstr, _ERRSTR_SIZE)
        if not rk:
            lib.rd_kafka_conf_destroy(conf)  # rd_kafka_new only takes ownership on success
            raise MockClusterError(f"rd_kafka_new failed: {errstr.value.decode(errors='replace')}")
        return int(rk)

    # -- lifecycle ---------------------------------------------------------

    def _handle(self) -> int:
        if self._mcluster is None:
            raise MockClusterError("MockCluster is closed")
        return self._mcluster

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._mcluster is None

    def close(self) -> None:
        """Stop the mock brokers and free the private handle; safe to repeat."""
        with self._lock:
            mcluster, rk = self._mcluster, self._rk
            self._mcluster = None
            self._rk = None
            # The cluster belongs to the handle, so it must go first.
            if mcluster is not None:
                self._lib.rd_kafka_mock_cluster_destroy(mcluster)
            if rk is not None:
                self._lib.rd_kafka_destroy(rk)

    def __enter__(self) -> MockCluster:
        self._handle()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Leaking a cluster leaks broker threads and listening sockets.
        try:
            if getattr(self, "_mcluster", None) is not None or getattr(self, "_rk", None) is not None:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else self._bootstrap_servers
        return f"<MockCluster brokers={getattr(self, '_brokers', '?')} {state}>"

    # -- cluster -----------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        """``host:port,...`` of the mock brokers, for ``bootstrap.servers``."""
        self._handle()
        return self._bootstrap_servers

    @property
    def broker_count(self) -> int:
        """How many brokers the mock cluster has."""
        return self._brokers

    def create_topic(self, name: str, partitions: int = 1, replication_factor: int = 1) -> str:
        """Create a topic up front (the mock otherwise auto-creates it with defaults)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"topic name must be a non-empty str, got {name!r}")
        if not is_int(partitions, 1):
            raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
        if not is_int(replication_factor, 1):
            raise ValueError(f"replication_factor must be an int >= 1, got {replication_factor!r}")
        with self._lock:
            err = self._lib.rd_kafka_mock_topic_create(self._handle(), name.encode(), partitions, replication_factor)
        if err:
            raise MockClusterError(f"cannot create mock topic {name!r}: {_err_name(err)}")
        return name

    def set_initial_rebalance_delay(self, ms: int) -> None:
        """Set ``group.initial.rebalance.delay.ms`` (mock default 3000) for all groups."""
        ms = _checked_int32(ms, "ms")
        if ms < 0:
            raise ValueError(f"ms must be >= 0, got {ms}")
        with self._lock:
            self._lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self._handle(), ms)

    # -- error injection ---------------------------------------------------

    def push_request_errors(self, api_key: ApiKey | int, *errors: int) -> None:
        """Make the next ``len(errors)`` requests of ``api_key`` fail, in order.

        ``errors`` are ``confluent_kafka.KafkaError`` codes (``KafkaError``
        instances are accepted too); ``KafkaError.NO_ERROR`` lets one request
        through and ``KafkaError._TRANSPORT`` makes the broker disconnect. The
        stack is shared by all brokers of the cluster.
        """
        key = _api_key(api_key)
        if not errors:
            raise ValueError("push_request_errors needs at least one error code")
        codes = [_error_code(e) for e in errors]
        array = (_err_t * len(codes))(*codes)
        with self._lock:
            self._lib.rd_kafka_mock_push_request_errors_array(self._handle(), key, len(codes), array)

    def clear_request_errors(self, api_key: ApiKey | int) -> None:
        """Drop errors still queued for ``api_key`` so later tests start clean."""
        key = _api_key(api_key)
        with self._lock:
            self._lib.rd_kafka_mock_clear_request_errors(self._handle(), key)

    def push_broker_request_errors(
        self,
        broker_id: int,
        api_key: ApiKey | int,
        *errors: int | tuple[int, int],
    ) -> None:
        """Like :meth:`push_request_errors` but for one broker, with optional delays.

        Each item is an error code or an ``(error_code, rtt_ms)`` pair; the
        broker answers after ``rtt_ms`` so timeouts can be provoked. Broker
        errors take precedence over cluster-wide ones.
        """
        broker_id = _checked_int32(broker_id, "broker_id")
        key = _api_key(api_key)
        if not errors:
            raise ValueError("push_broker_request_errors needs at least one error")
        # ctypes caps a call at 1024 arguments; 4 are fixed, each pair takes 2.
        if len(errors) > 500:
            raise ValueError("push_broker_request_errors takes at most 500 errors per call")
        varargs: list[ctypes.c_int] = []
        for item in errors:
            if isinstance(item, tuple):
                if len(item) != 2:
                    raise ValueError(f"expected an (error_code, rtt_ms) pair, got {item!r}")
                code, rtt = _error_code(item[0]), _checked_int32(item[1], "rtt_ms")
                if rtt < 0:
                    raise ValueError(f"rtt_ms must be >= 0, got {rtt}")
            else:
                code, rtt = _error_code(item), 0
            varargs += [ctypes.c_int(code), ctypes.c_int(rtt)]
        func = self._optional("rd_kafka_mock_broker_push_request_error_rtts")
        with self._lock:
            err = func(self._handle(), broker_id, key, len(errors), *varargs)
        if err:
            raise MockClusterError(f"cannot push errors to mock broker {broker_id}: {_err_name(err)}")

    def broker_down(self, broker_id: int = 1) -> None:
        """Disconnect a broker and refuse connections (-1 means every broker).

        Partition leadership does not move, so clients just see the broker
        as unreachable until :meth:`broker_up`.
        """
        self._set_broker(broker_id, up=False)

    def broker_up(self, broker_id: int = 1) -> None:
        """Accept connections again on the same port (-1 means every broker)."""
        self._set_broker(broker_id, up=True)

    def _set_broker(self, broker_id: int, *, up: bool) -> None:
        broker_id = _checked_int32(broker_id, "broker_id")
        func = self._lib.rd_kafka_mock_broker_set_up if up else self._lib.rd_kafka_mock_broker_set_down
        with self._lock:
            err = func(self._handle(), broker_id)
        if err:
            state = "up" if up else "down"
            raise MockClusterError(f"cannot set mock broker {broker_id} {state}: {_err_name(err)}")

    # -- request tracking --------------------------------------------------

    @property
    def supports_request_tracking(self) -> bool:
        """Whether this librdkafka can record the requests clients send."""
        return all(_has(self._lib, name) for name in _TRACKING)

    def _optional(self, name: str) -> Any:
        if not _has(self._lib, name):
            raise MockClusterError(f"this librdkafka has no {name}; the feature is unavailable")
        return getattr(self._lib, name)

    def start_request_tracking(self) -> None:
        """Record every request from now on (clears anything recorded before)."""
        func = self._optional("rd_kafka_mock_start_request_tracking")
        with self._lock:
            func(self._handle())

    def stop_request_tracking(self) -> None:
        """Stop recording. librdkafka also discards what was recorded, so call
        :meth:`requests` first."""
        func = self._optional("rd_kafka_mock_stop_request_tracking")
        with self._lock:
            func(self._handle())

    def clear_requests(self) -> None:
        """Forget recorded requests but keep tracking."""
        func = self._optional("rd_kafka_mock_clear_requests")
        with self._lock:
            func(self._handle())

    def requests(self) -> list[MockRequest]:
        """Requests recorded since tracking started, oldest first."""
        get = self._optional("rd_kafka_mock_get_requests")
        for name in _TRACKING:
            self._optional(name)
        lib = self._lib
        count = _size_t(0)
        with self._lock:
            array = get(self._handle(), ctypes.byref(count))
        if not array or count.value == 0:
            return []
        try:
            result = []
            for i in range(count.value):
                mreq = array[i]
                raw_key = int(lib.rd_kafka_mock_request_api_key(mreq))
                api_key: ApiKey | int
                try:
                    api_key = ApiKey(raw_key)
                except ValueError:
                    api_key = raw_key
                result.append(
                    MockRequest(
                        broker_id=int(lib.rd_kafka_mock_request_id(mreq)),
                        api_key=api_key,
                        timestamp_us=int(lib.rd_kafka_mock_request_timestamp(mreq)),
                    )
                )
            return result
        finally:
            lib.rd_kafka_mock_request_destroy_array(array, count.value)

    def requests_for(self, api_keys: ApiKey | int | Sequence[ApiKey | int]) -> list[MockRequest]:
        """Recorded requests of the given type(s), for counting retries."""
        wanted = {_api_key(k) for k in api_keys} if isinstance(api_keys, Sequence) else {_api_key(api_keys)}
        return [r for r in self.requests() if int(r.api_key) in wanted]
