"""Probe: static group membership (group.instance.id, KIP-345) on noida-db.

    python tools/probes/static_membership.py [SCENARIO ...] [--reps N]

Scenarios (default: all), each with two plain confluent-kafka members in
subprocesses (tools/probes/_member.py), a 4-partition topic, a fresh group,
session.timeout.ms=6000, heartbeat.interval.ms=500, max.poll.interval.ms=30000:

- ``kill-same-id``   SIGKILL w0, restart it 2 s later under the same group.instance.id
- ``kill-new-id``    SIGKILL w0, restart it 2 s later under a new group.instance.id
- ``close-static``   w0 (static) calls consumer.close(); nobody restarts it
- ``close-dynamic``  the same without group.instance.id, for comparison
- ``kill-dynamic``   SIGKILL w0 (no instance id), restart 2 s later (the issue-13 baseline)

For each run it prints: when the group was stable again (every partition
owned by exactly one live member) counted from the kill/close, when the
restarted member had partitions again, the rebalance callbacks the
surviving member w1 got, and any moment two members owned one partition.
A run that is not stable after --timeout seconds (90) is reported as such.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _group import Group  # noqa: E402

from kafkatx.local import LocalBroker  # noqa: E402

PARTITIONS = 4
TIMEOUT = 90.0  # --timeout
SCENARIOS = ["kill-same-id", "kill-new-id", "close-static", "close-dynamic", "kill-dynamic"]


def run(bootstrap: str, scenario: str) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    suffix = uuid.uuid4().hex[:6]
    topic, group = f"static-{suffix}", f"g-{suffix}"
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(10)
    static = scenario in ("kill-same-id", "kill-new-id", "close-static")
    g = Group(bootstrap, group, topic)
    try:
        w0 = g.start("w0", "w0" if static else None, close_after=None)
        w1 = g.start("w1", "w1" if static else None)
        if g.wait(lambda: g.stable(PARTITIONS, ["w0", "w1"]), 60) is None:
            return f"initial group never stable: {g.ownership()}"
        g.watch(1.0)
        before = g.ownership()
        g.overlaps = []
        if scenario.startswith("kill"):
            t0 = w0.kill()
            time.sleep(2.0)
            new_id = {"kill-same-id": "w0", "kill-new-id": "w0-new-" + suffix}.get(scenario)
            r = g.start("w0r", new_id)
            t_back = g.wait(lambda: bool(r.owned()), TIMEOUT)
            t_stable = g.wait(lambda: g.stable(PARTITIONS, ["w0r", "w1"]), max(0.0, TIMEOUT - (time.time() - t0)))
            g.watch(10)  # does it stay stable?
            still = g.stable(PARTITIONS, ["w0r", "w1"])
            same = sorted(r.owned()) == sorted(before["w0"])
            w1_events = [(round(e["t"] - t0, 2), e["event"], e["partitions"]) for e in w1.events_after(t0)]
            return (
                f"restarted member has partitions after {_dt(t_back, t0)} (same as before: {same}); "
                f"group stable after {_dt(t_stable, t0)}, still stable 10 s later: {still}; "
                f"w1 callbacks after the kill: {w1_events or 'none'}; overlaps: {_overlaps(g, t0)}"
            )
        # close scenarios: w0 closes cleanly (SIGTERM -> consumer.close())
        t0 = w0.term()
        w0.proc.wait(30)
        t_closed = next((e["t"] for e in w0.events if e["event"] == "closed"), None)
        t_all = g.wait(lambda: sorted(w1.owned()) == list(range(PARTITIONS)), TIMEOUT)
        w1_events = [(round(e["t"] - t0, 2), e["event"], e["partitions"]) for e in w1.events_after(t0)]
        return (
            f"close() returned after {_dt(t_closed, t0)}; w1 owns all partitions after {_dt(t_all, t0)}; "
            f"w1 callbacks: {w1_events or 'none'}"
        )
    finally:
        g.stop()


def _dt(t: float | None, t0: float) -> str:
    return f"never ({TIMEOUT:.0f} s)" if t is None else f"{t - t0:.1f} s"


def _overlaps(g: Group, t0: float) -> str:
    if not g.overlaps:
        return "none"
    first, last = g.overlaps[0][0] - t0, g.overlaps[-1][0] - t0
    parts = sorted({p for _, ps in g.overlaps for p in ps})
    return f"partitions {parts} doubly owned between +{first:.1f} s and +{last:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=", ".join(SCENARIOS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--timeout", type=float, default=TIMEOUT, help="seconds to wait for the group to settle (default 90)"
    )
    args = ap.parse_args()
    globals()["TIMEOUT"] = args.timeout
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    with LocalBroker() as broker:
        for scenario in args.scenarios or SCENARIOS:
            for i in range(args.reps):
                print(f"{scenario} #{i + 1}: {run(broker.bootstrap_servers, scenario)}", flush=True)


if __name__ == "__main__":
    main()
