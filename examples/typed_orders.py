"""Example: a typed handler. JSON orders in, validated by a pydantic model; Avro invoices out, through Schema Registry.

The handler receives an ``Order`` object, never bytes, and returns an
``Invoice`` model, which confluent-kafka's ``AvroSerializer`` writes in the
Schema Registry wire format. An order that is not JSON, or that fails the
model's validation, never reaches the handler: it is dead-lettered at once
(attempt 1), byte for byte, with headers saying which field failed
(docs/TYPED.md).

It needs pydantic and confluent-kafka's Avro serdes (in a clone:
``pip install -e '.[local,pydantic,avro]'``). Without ``SCHEMA_REGISTRY_URL``
it uses confluent-kafka's in-process mock registry::

    kafkatx run examples.typed_orders:app --local --local-port 9092

and from another terminal::

    printf '{"id": 1, "qty": 2, "price": 3.5}\\n{"id": 2, "qty": 0, "price": 1}\\nnot json\\n' | kafkatx produce typed-orders
    kafkatx dlq inspect typed-orders-dlt    # order 2 (qty: greater than 0) and the line that is not JSON

With a real registry: ``SCHEMA_REGISTRY_URL=http://registry:8081 kafkatx run examples.typed_orders:app``.
"""

from __future__ import annotations

import json
import os

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from pydantic import BaseModel, Field

from kafkatx import App, Record

app = App("typed-orders", create_topics=True, topic_partitions=2)

INVOICE_SCHEMA = json.dumps(
    {
        "type": "record",
        "name": "Invoice",
        "fields": [{"name": "order", "type": "int"}, {"name": "total", "type": "double"}],
    }
)
registry = SchemaRegistryClient.new_client({"url": os.environ.get("SCHEMA_REGISTRY_URL", "mock://typed-orders")})


class Order(BaseModel):
    id: int
    qty: int = Field(gt=0)
    price: float = Field(ge=0)


class Invoice(BaseModel):
    order: int
    total: float


@app.listener(
    "typed-orders",
    output="typed-invoices",
    value_type=Order,  # JSON, validated: record.value is an Order
    serializer=AvroSerializer(registry, INVOICE_SCHEMA),  # the returned Invoice, in the registry's wire format
    dlq=True,
)
def invoice(record: Record) -> Invoice:
    order: Order = record.value
    return Invoice(order=order.id, total=round(order.qty * order.price, 2))
