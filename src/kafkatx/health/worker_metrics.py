"""One Prometheus scrape for ``kafkatx run --workers N``: the workers' expositions merged, each sample labelled.

Each worker serves its ``/metrics`` on the free port it reports to the
supervisor (kafkatx.health.workers); the supervisor, asked for ``/metrics``,
reads every running worker's and merges them family by family, adding a
``worker`` label (its instance id) to each sample, so that one scrape sees
every worker and their series never collide. Needs the metrics extra
(prometheus_client's parser and exposition).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from kafkatx.health.workers import WorkerState

__all__ = ["merge_expositions", "workers_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def merge_expositions(expositions: Iterable[tuple[str, str]]) -> bytes:
    """``(worker, exposition text)`` pairs as one exposition: a family once, its samples labelled by worker."""
    from prometheus_client.core import Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector, CollectorRegistry

    families: dict[str, Metric] = {}
    for worker, text in expositions:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [_labelled(s, worker) for s in family.samples]

    class _Merged(Collector):
        def collect(self) -> Iterable[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


def workers_metrics(workers: Sequence[WorkerState], timeout: float = 2.0) -> bytes:
    """The merged exposition of every running worker that answers (one that does not is left out, not waited for)."""
    texts: list[tuple[str, str]] = []
    for w in workers:
        if w.process != "running" or w.port is None:
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{w.port}/metrics", timeout=timeout) as response:
                texts.append((w.instance_id, response.read().decode()))
        except (OSError, urllib.error.URLError, ValueError):
            continue
    return merge_expositions(texts)


def _labelled(sample: Any, worker: str) -> Any:
    """``sample`` with a ``worker`` label (a Sample is a tuple whose second field is its labels)."""
    fields = list(sample)
    fields[1] = {**sample.labels, "worker": worker}
    return type(sample)(*fields)
