"""Probe: cooperative (incremental) rebalancing on noida-db.

    python tools/probes/cooperative_rebalance.py [--strategy cooperative-sticky|range] [--reps N]

Plain confluent-kafka members in subprocesses (tools/probes/_member.py),
a 6-partition topic, session.timeout.ms=6000, max.poll.interval.ms=30000,
partition.assignment.strategy as given. Steps: m1 joins; m2 joins; m3
joins; m2 closes cleanly; m3 is SIGKILLed. After each step it waits until
every partition has exactly one live owner and prints how long that took,
each member's rebalance callbacks during the step (with cooperative
rebalancing the callbacks carry only the partitions that move, and a
member's other partitions stay assigned throughout), whether a member that
kept partitions was ever left with none in between, and any moment two
members owned one partition.
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

PARTITIONS = 6


def step_report(g: Group, t0: float, t_stable: float | None, names: list[str]) -> str:
    lines = [f"  stable after {'never (90 s)' if t_stable is None else f'{t_stable - t0:.1f} s'}: {g.ownership()}"]
    for name in names:
        m = g.members[name]
        cbs = [f"+{e['t'] - t0:.1f}s {e['event']} {e['partitions']}" for e in m.events_after(t0)]
        owned_seq = [e["partitions"] for e in m.events if e["t"] >= t0 and e["event"] == "owned"]
        dropped_to_zero = any(not o for o in owned_seq[:-1]) and bool(owned_seq and owned_seq[-1])
        lines.append(
            f"  {name}: callbacks {cbs or 'none'}; assignment went through {owned_seq or 'no change'}"
            + ("  <- had NO partitions in between" if dropped_to_zero else "")
        )
    if getattr(g, "overlaps", None):
        ps = sorted({p for _, o in g.overlaps for p in o})
        lines.append(
            f"  OVERLAP: partitions {ps} doubly owned between +{g.overlaps[0][0] - t0:.1f}s and +{g.overlaps[-1][0] - t0:.1f}s"
        )
    return "\n".join(lines)


def run(bootstrap: str, strategy: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    suffix = uuid.uuid4().hex[:6]
    topic = f"coop-{suffix}"
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(10)
    g = Group(bootstrap, f"g-{suffix}", topic)
    cfg = {"partition.assignment.strategy": strategy}
    live: list[str] = []
    try:
        for action, name in (("join", "m1"), ("join", "m2"), ("join", "m3"), ("close", "m2"), ("kill", "m3")):
            g.overlaps = []
            t0 = time.time()
            if action == "join":
                g.start(name, config=cfg)
                live.append(name)
            elif action == "close":
                g.members[name].term()
                g.members[name].proc.wait(30)
                live.remove(name)
            else:
                g.members[name].kill()
                live.remove(name)
            t_stable = g.wait(lambda: g.stable(PARTITIONS, live), 90)
            g.watch(2.0)  # settle: does it stay that way?
            print(f"{action} {name}:\n{step_report(g, t0, t_stable, live)}", flush=True)
    finally:
        g.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="cooperative-sticky")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    with LocalBroker() as broker:
        for i in range(args.reps):
            print(f"=== {args.strategy} run {i + 1}")
            run(broker.bootstrap_servers, args.strategy)


if __name__ == "__main__":
    main()
