"""The HTTP endpoint of the probes: ``/livez``, ``/readyz`` and, with the metrics extra, ``/metrics``.

A stdlib :class:`http.server.ThreadingHTTPServer` on a daemon thread: a
probe is a few requests a minute, and the answer is computed from the
containers' public state when asked, so serving costs the App nothing
between requests.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx._served import ServedEndpoint
from kafkatx.errors import InvalidConfigurationError
from kafkatx.health.checks import Verdict, check_health_options, liveness, readiness
from kafkatx.health.snapshot import ContainerView, HealthSource, listener_states
from kafkatx.health.stable_offsets import StableOffsetWatch
from kafkatx.metrics.lag import InstrumentedApp, MeteredContainer

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["HealthApp", "HealthServer", "Response", "serve_health", "verdict_response"]

log = logging.getLogger("kafkatx.health")

#: What a route answers: HTTP status, content type, body.
Response = tuple[int, str, bytes]
_JSON = "application/json"


class _ProbedContainer(ContainerView, MeteredContainer, Protocol):
    """A container as the health endpoint reads it, for the probes and for the metrics on the same port."""


class HealthApp(HealthSource, InstrumentedApp, Protocol):
    """A :class:`kafkatx.App` as the health endpoint sees it (its probes, and its metrics when installed)."""

    @property
    def containers(self) -> Sequence[_ProbedContainer]: ...
    @property
    def listeners(self) -> Sequence[ListenerSpec]: ...


def verdict_response(verdict: Verdict) -> Response:
    return verdict.status, _JSON, json.dumps(verdict.body, indent=1).encode() + b"\n"


class HealthServer(ServedEndpoint):
    """A running health endpoint (routes ``/livez``, ``/readyz``, maybe ``/metrics``); :meth:`stop` frees it."""

    def __init__(self, routes: Mapping[str, Callable[[], Response]], port: int, addr: str = "127.0.0.1") -> None:
        check_health_options(port, addr, 1.0)
        self.routes = dict(routes)
        handler = _handler_for(self.routes)
        try:
            server_class = _IPv6Server if ":" in addr else ThreadingHTTPServer  # "::" for every interface, IPv6 too
            server = server_class((addr, port), handler)
        except OSError as exc:
            raise InvalidConfigurationError(
                f"cannot serve health probes on {addr}:{port}: {exc.strerror or exc}. "
                "Pick another port (0 picks a free one)"
            ) from exc
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="kafkatx-health", daemon=True)
        thread.start()
        super().__init__(server, thread, addr)

    def __enter__(self) -> HealthServer:
        return self


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler_for(routes: Mapping[str, Callable[[], Response]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                status, ctype, body = 404, "text/plain", f"not found; try {', '.join(sorted(routes))}\n".encode()
            else:
                try:
                    status, ctype, body = route()
                except Exception as exc:  # a probe that cannot answer says so, and the server goes on
                    log.exception("health route %s failed", self.path)
                    status, ctype, body = 500, "text/plain", f"{type(exc).__name__}: {exc}\n".encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug("health %s: " + format, self.client_address[0], *args)

    return Handler


def app_routes(app: HealthApp, metrics: Callable[[], bytes] | None = None) -> dict[str, Callable[[], Response]]:
    """The routes of an App's endpoint: its probes, and ``/metrics`` when ``metrics`` gives an exposition."""
    routes: dict[str, Callable[[], Response]] = {
        "/livez": lambda: verdict_response(liveness(listener_states(app))),
        "/readyz": lambda: verdict_response(_readiness_of(app)),
    }
    if metrics is not None:
        routes["/metrics"] = lambda: (200, "text/plain; version=0.0.4; charset=utf-8", metrics())
    return routes


def _readiness_of(app: HealthApp) -> Verdict:
    """``/readyz``'s verdict, its body also naming the written partitions whose last stable offset is stuck.

    Named only: a stuck partition never makes the App not ready (it can still process; what holds its readers
    back is another producer's open transaction), and it is reported by a metric, an event and a warning.
    """
    verdict = readiness(listener_states(app), app.not_ready_after)
    watch: StableOffsetWatch | None = getattr(app, "stable_offsets", None)
    stuck = watch.stuck() if watch is not None else []
    if stuck:
        verdict.body["last_stable_offset_stuck"] = [partition.as_json() for partition in stuck]
    return verdict


def _metrics_of(app: HealthApp) -> Callable[[], bytes] | None:
    """The App's Prometheus exposition when the metrics extra is installed (instrumenting the App), else None."""
    if importlib.util.find_spec("prometheus_client") is None:
        return None
    from kafkatx.metrics import instrument

    return instrument(app).exposition


def serve_health(app: HealthApp, port: int, addr: str = "127.0.0.1") -> HealthServer:
    """Serve ``app``'s ``/livez`` and ``/readyz`` (and ``/metrics``, metrics extra installed) from a daemon thread.

    ``port=0`` picks a free port (read it from ``.port``). Call it before
    ``app.start()`` for consumer lag in ``/metrics`` (``App(health_port=...)``
    does). The default address only accepts local probes; pass
    ``addr="0.0.0.0"`` for a kubelet that probes the pod's IP.
    """
    check_health_options(port, addr, app.not_ready_after)
    server = HealthServer(app_routes(app, _metrics_of(app)), port, addr)
    log.info("serving health probes of app %s at %s (%s)", app.name, server.url, ", ".join(server.routes))
    return server
