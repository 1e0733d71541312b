"""Example kafkatx App: a batch listener that scores a whole batch of sensor readings at once with numpy.

The handler gets a list of records (a poll's, up to ``max_batch_records``),
parses their JSON values, and computes every score in one vectorized numpy
expression instead of one Python call per record. A reading that cannot be
scored is named with ``kafkatx.RecordFailedError(record) from err``: the
readings before it commit, it alone is dead-lettered (``BadReading`` is not
retryable), and the readings after it are scored next (docs/BATCH.md). Each
score keeps its reading's key. It needs numpy. Run it against the embedded
broker::

    kafkatx run examples.batch_scores:app --local --local-port 9092

and give it readings from another terminal::

    printf 's1\t{"temp": 21.5}\ns2\t{"temp": 35}\ns3\t{"temp": "hot"}\n' | kafkatx produce readings --kv
    kafkatx dlq inspect readings-dlt    # s3's reading: its temperature is not a number
"""

from __future__ import annotations

import json
import math

import numpy as np

import kafkatx
from kafkatx import App, Record

#: The score is a logistic curve of the temperature: 0.5 at NORMAL, near 1 well above it.
NORMAL, SPREAD = 25.0, 4.0

app = App("batch-scores", create_topics=True, topic_partitions=2)


class BadReading(ValueError):
    """The reading has no numeric temperature: retrying will not help, so it is dead-lettered at once."""


def temperature(record: Record) -> float:
    """The reading's temperature, or BadReading."""
    try:
        temp = json.loads(record.value or b"")["temp"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadReading(f"not a reading: {exc}") from exc
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp):
        raise BadReading(f"temp is not a finite number: {temp!r}")
    return float(temp)


@app.batch_listener(
    "readings",
    output="reading-scores",
    max_attempts=3,
    backoff=0.1,
    dlq=True,  # readings-dlt
    not_retryable=(BadReading,),
    max_batch_records=1000,
)
def score(records: list[Record]) -> list[tuple[bytes | None, bytes]]:
    """One score per reading, ``{"temp": ..., "score": ...}``, computed for the whole batch in one numpy call."""
    temps = np.empty(len(records))
    for i, record in enumerate(records):
        try:
            temps[i] = temperature(record)
        except BadReading as exc:
            raise kafkatx.RecordFailedError(record) from exc
    scores = 1.0 / (1.0 + np.exp(-(temps - NORMAL) / SPREAD))  # vectorized: the batch at once
    return [
        (record.key, json.dumps({"temp": t, "score": round(s, 4)}).encode())
        for record, t, s in zip(records, temps.tolist(), scores.tolist())
    ]
