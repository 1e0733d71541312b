"""One worker process vs ``kafkatx run --workers 2`` on the same input (issue 13: processes use the cores).

    python bench/scaling.py                     # 200,000 JSON records, 4 partitions, 2 rounds
    python bench/scaling.py --records 50000 --rounds 1

The handler does what a typical transform does per record: parse JSON, add a
field, serialise, keep the key. Each run is a real ``kafkatx run`` command
(supervisor and workers are separate processes) on the embedded broker, timed
from the command's start to the group's last commit; the output is checked
(every record once). On a 2-core machine the broker shares the cores with
the workers, so the gain is bounded by what the broker leaves free.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kafkatx.local import LocalBroker  # noqa: E402
from kafkatx.testing import KafkaTestKit  # noqa: E402

APP = textwrap.dedent(
    """
    import json, os
    from kafkatx import App, Record

    app = App(os.environ["APP_NAME"])

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=1000)
    def enrich(record: Record) -> tuple[bytes | None, bytes]:
        order = json.loads(record.value)
        order["total"] = round(order["qty"] * order["price"], 2)
        return record.key, json.dumps(order).encode()
    """
)


def run_once(workdir: Path, bootstrap: str, kit: KafkaTestKit, src: str, n: int, workers: int) -> float:
    out = kit.topic(partitions=4)
    name = f"scale-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "PYTHONPATH": f"{workdir}:{ROOT / 'src'}"}
    cmd = [
        sys.executable,
        "-m",
        "kafkatx",
        "run",
        "scale_app:app",
        "--bootstrap-servers",
        bootstrap,
        "--instance-id",
        name,
        "--no-status",
        "--workers",
        str(workers),
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not kit.caught_up(name, src):
            if proc.poll() is not None:
                raise RuntimeError(f"kafkatx run exited with {proc.returncode}")
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    values = Counter(kit.values(out))
    assert len(values) == n and max(values.values()) == 1, "every record exactly once"
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kafkatx-scaling-"))
    (tmp / "scale_app.py").write_text(APP)
    broker = LocalBroker(data_dir=tmp / "kafka").start()
    try:
        kit = KafkaTestKit(broker.bootstrap_servers)
        src = kit.topic(partitions=4)
        kit.produce(
            src,
            [
                (f"c{i % 1000}".encode(), json.dumps({"id": i, "qty": i % 7 + 1, "price": 9.99}).encode())
                for i in range(args.records)
            ],
        )
        rates: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for workers in (1, 2):
                rates[workers].append(run_once(tmp, broker.bootstrap_servers, kit, src, args.records, workers))
        print(f"{args.records} JSON records, 4 partitions, {os.cpu_count()} cores, wall clock from `kafkatx run` start")
        for workers, runs in rates.items():
            print(
                f"  --workers {workers}: {statistics.median(runs):8.0f} rec/s (runs {', '.join(f'{r:.0f}' for r in runs)})"
            )
        print(f"  speed-up: {statistics.median(rates[2]) / statistics.median(rates[1]):.2f}x")
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
