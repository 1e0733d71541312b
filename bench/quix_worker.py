"""Run 5: quixstreams with processing_guarantee="exactly-once", same workload.

Runs inside bench/.venv-quix (quixstreams 3.28.1 pins confluent-kafka<2.13,
so it can never share the project's environment). ``bench/run.py`` starts it
as ``<venv>/bin/python bench/quix_worker.py '<json config>'`` and reads the
last stdout line (``RESULT {...}``). Timing and latency are defined as in
workers.py; the commit hook wraps quixstreams' Checkpoint.commit, which
commits the Kafka transaction (offsets + outputs) and returns.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

perf = time.perf_counter


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING)
    from quixstreams import Application
    from quixstreams.checkpointing import checkpoint as ckpt

    n, every = cfg["records"], cfg["sample_every"]
    state: dict[str, Any] = {
        "t_first": None,
        "t_last": None,
        "seen": 0,
        "txns": 0,
        "aborts": 0,
        "cpu_first": 0.0,
        "cpu_last": 0.0,
    }
    first: dict[int, float] = {}
    pending: list[int] = []
    lat: list[float] = []

    original_commit = ckpt.Checkpoint.commit
    original_close = ckpt.Checkpoint.close

    def commit(self: Any, *args: Any, **kwargs: Any) -> Any:
        empty = self.empty()
        result = original_commit(self, *args, **kwargs)
        if not empty:
            now = perf()
            state["txns"] += 1
            state["t_last"] = now
            state["cpu_last"] = time.thread_time()
            state["proc_last"] = time.process_time()
            for key in pending:
                t = first.pop(key, None)
                if t is not None:
                    lat.append(now - t)
            pending.clear()
        return result

    def close(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.empty():
            state["aborts"] += 1
            pending.clear()
        return original_close(self, *args, **kwargs)

    ckpt.Checkpoint.commit = commit  # type: ignore[method-assign]
    ckpt.Checkpoint.close = close  # type: ignore[method-assign]

    app_kwargs: dict[str, Any] = {
        "broker_address": cfg["bootstrap"],
        "consumer_group": cfg["group"],
        "auto_offset_reset": "earliest",
        "processing_guarantee": "exactly-once",
        "loglevel": "WARNING",
        "auto_create_topics": False,
        "use_changelog_topics": False,
        "state_dir": cfg["state_dir"],
        "consumer_extra_config": {
            "receive.message.max.bytes": 1_000_000_000
        },  # LocalBroker.client_config (no kafkatx here)
    }
    if cfg.get("commit_interval") is not None:
        app_kwargs["commit_interval"] = float(cfg["commit_interval"])
    t0 = perf()
    app = Application(**app_kwargs)
    src = app.topic(cfg["input"], key_deserializer="bytes", value_deserializer="bytes")
    dst = app.topic(cfg["output"], key_serializer="bytes", value_serializer="bytes")

    def upper(value: bytes) -> bytes:
        if state["t_first"] is None:
            state["cpu_first"] = time.thread_time()
            state["proc_first"] = time.process_time()
            state["t_first"] = perf()
        state["seen"] += 1
        i = state["seen"]
        if i % every == 0:
            first[i] = perf()
            pending.append(i)
        return value.upper()

    sdf = app.dataframe(src)
    sdf = sdf.apply(upper)
    sdf.to_topic(dst)
    app.run(count=n, collect=False)
    t_last = state["t_last"]
    lat.sort()

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000.0 if lat else None

    to_wall = time.time() - time.perf_counter()
    res = {
        "window": [state["t_first"] + to_wall, t_last + to_wall],
        "records": n,
        "wall_s": t_last - t0,
        "startup_s": state["t_first"] - t0,
        "processing_s": t_last - state["t_first"],
        "txns_committed": state["txns"],
        "txns_aborted": state["aborts"],
        "committed_records": state["seen"],
        "latency_samples": len(lat),
        "latency_p50_ms": pct(0.50),
        "latency_p99_ms": pct(0.99),
        "latency_max_ms": lat[-1] * 1000.0 if lat else None,
        "thread_cpu_s": state["cpu_last"] - state["cpu_first"],
        "process_cpu_s": state.get("proc_last", 0.0) - state.get("proc_first", 0.0),
        "quixstreams_commit_interval_s": app._config.commit_interval,
    }
    try:  # VmHWM, not ru_maxrss: see workers.peak_rss_mib
        with open("/proc/self/status") as status:
            res["peak_rss_mib"] = next(int(x.split()[1]) / 1024.0 for x in status if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        res["peak_rss_mib"] = None
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
