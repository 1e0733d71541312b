"""Liveness and readiness probes of an App for an orchestrator (Kubernetes), on one HTTP port.

``App(health_port=...)`` (or ``kafkatx run --health-port N``) serves
``/livez``, ``/readyz`` and, with the metrics extra installed, ``/metrics``;
the rules are in :mod:`kafkatx.health.checks`, the endpoints and their JSON
in ``docs/OBSERVABILITY.md``.
"""

from __future__ import annotations

from kafkatx.health.checks import DEFAULT_NOT_READY_AFTER, ContainerState, ListenerState, Verdict, liveness, readiness
from kafkatx.health.server import HealthServer, serve_health

__all__ = [
    "DEFAULT_NOT_READY_AFTER",
    "ContainerState",
    "HealthServer",
    "ListenerState",
    "Verdict",
    "liveness",
    "readiness",
    "serve_health",
]
