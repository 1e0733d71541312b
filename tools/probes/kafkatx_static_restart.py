"""Probe: a kafkatx worker SIGKILLed and restarted, with static membership, on noida-db.

    python tools/probes/kafkatx_static_restart.py [--new-id] [--reps N]

Two `kafkatx run` workers (instance ids w0, w1; group fencing) copy a
4-partition topic to an output topic while records keep arriving (200/s).
Each worker's consumer gets ``group.instance.id = <instance id>`` through
the listener's consumer_config (what issue 13 item 1 will derive
automatically), session.timeout.ms=6000, max.poll.interval.ms=30000. w0 is
SIGKILLed and restarted 2 s later under the same instance id (or, with
--new-id, under a new one). Printed per run: how long after the kill every
partition's committed offset moved again, whether w1 logged a revocation,
and at the end (input stopped, all committed) whether the output equals the
input exactly once.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from confluent_kafka import Producer

from kafkatx import App, Record
from kafkatx.local import LocalBroker
from kafkatx.testing import KafkaTestKit

PARTITIONS = 4


def app() -> App:
    """The worker's App (``kafkatx run kafkatx_static_restart:app``), configured from the environment."""
    instance = os.environ["KAFKATX_INSTANCE_ID"]
    a = App(os.environ["PROBE_APP"], instance_id=instance)

    @a.listener(
        os.environ["PROBE_SRC"],
        output=os.environ["PROBE_OUT"],
        max_batch_ms=50,
        consumer_config={
            "group.instance.id": instance,
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "max.poll.interval.ms": 30000,
        },
    )
    def copy(record: Record) -> tuple[bytes | None, bytes | None]:
        return record.key, record.value

    return a


def run(broker: LocalBroker, new_id: bool) -> str:
    kit = KafkaTestKit(broker.bootstrap_servers)
    src, out = kit.topic(partitions=PARTITIONS), kit.topic(partitions=PARTITIONS)
    name = "static-" + uuid.uuid4().hex[:6]
    env = {
        **os.environ,
        "PROBE_APP": name,
        "PROBE_SRC": src,
        "PROBE_OUT": out,
        "KAFKATX_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
        "PYTHONPATH": str(Path(__file__).resolve().parent),
    }
    logs: dict[str, list[str]] = {}

    def worker(instance: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-m", "kafkatx", "run", "kafkatx_static_restart:app", "--no-status"],
            env={**env, "KAFKATX_INSTANCE_ID": instance},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = logs.setdefault(instance, [])

        def read() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                lines.append(f"{time.time():.2f} {line.rstrip()}")

        threading.Thread(target=read, daemon=True).start()
        return p

    sent = 0
    stop = threading.Event()

    def feed() -> None:
        nonlocal sent
        prod = Producer({"bootstrap.servers": broker.bootstrap_servers, "log_level": 0})
        while not stop.is_set():
            for _ in range(20):
                prod.produce(src, b"%d" % sent, key=b"%d" % sent)
                sent += 1
            prod.poll(0)
            time.sleep(0.1)
        prod.flush(10)

    w0, w1 = worker("w0"), worker("w1")
    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        deadline = time.monotonic() + 60
        while not (kit.committed(name, src).keys() >= set(range(PARTITIONS))) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        t_kill = time.time()
        w0.send_signal(signal.SIGKILL)
        w0.wait()
        at_kill = kit.committed(name, src)
        time.sleep(2)
        w0 = worker("w0-new" if new_id else "w0")
        moved: dict[int, float] = {}
        deadline = time.monotonic() + 120
        while len(moved) < PARTITIONS and time.monotonic() < deadline:
            now = kit.committed(name, src)
            for p, off in now.items():
                if p not in moved and off > at_kill.get(p, 0):
                    moved[p] = time.time() - t_kill
            time.sleep(0.1)
        stop.set()
        feeder.join()
        deadline = time.monotonic() + 120
        while not kit.caught_up(name, src) and time.monotonic() < deadline:
            time.sleep(0.2)
        caught_up = kit.caught_up(name, src)
    finally:
        t_stop = time.time()
        stop.set()
        for p in (w0, w1):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    values = Counter(kit.values(out))
    dups = sum(n - 1 for n in values.values() if n > 1)
    missing = sent - len(values)
    w1_revoked = [ln for ln in logs.get("w1", []) if "revoked" in ln and t_kill < float(ln.split()[0]) < t_stop]
    stall = {p: f"{t:.1f}s" for p, t in sorted(moved.items())}  # checks start 2 s after the kill
    return (
        f"committed offsets moving again after the kill: {stall} (partitions missing: "
        f"{sorted(set(range(PARTITIONS)) - set(moved)) or 'none'}); w1 revocations after the kill: {len(w1_revoked)}; "
        f"all committed at the end: {caught_up}; {sent} records in, {len(values)} distinct out, "
        f"duplicates {dups}, missing {missing}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-id", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    with LocalBroker() as broker:
        for i in range(args.reps):
            print(f"{'new id' if args.new_id else 'same id'} #{i + 1}: {run(broker, args.new_id)}", flush=True)


if __name__ == "__main__":
    main()
