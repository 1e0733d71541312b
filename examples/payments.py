"""The README's one-screen example, runnable: book payments into a ledger, audit each, exactly once.

    kafkatx run examples.payments:app --local --local-port 9092

and from another terminal (the tools find a broker on port 9092 by themselves)::

    printf 'p1\t{"id": 1, "amount": 25}\np2\t{"id": 2, "amount": -5}\n' | kafkatx produce payments --kv
    kafkatx dlq inspect payments-dlt    # payment 2: amount must be positive
"""

import json

import tenacity

from kafkatx import App, Record, send

app = App("payments", create_topics=True)


def make_entry(raw: bytes | None) -> bytes:
    payment = json.loads(raw or b"")  # not JSON: ValueError, dead-lettered at once
    if payment["amount"] <= 0:
        raise ValueError(f"payment {payment['id']}: amount must be positive")
    return json.dumps({"id": payment["id"], "debit": payment["amount"]}).encode()


@app.listener(
    "payments",
    output="ledger",
    sends_to=("audit",),
    max_attempts=3,
    backoff=tenacity.wait_exponential(multiplier=0.1, max=5),
    dlq=True,
    not_retryable=(ValueError,),
)
def book(record: Record) -> bytes:
    entry = make_entry(record.value)  # raise to roll back
    send("audit", entry, key=record.key)  # joins the same transaction
    return entry  # goes to "ledger", without a key (docs/HANDLERS.md, "Keys")
