"""A batch handler call's outputs: held until the call returned, then produced in order in the open transaction.

A batch handler mostly returns one bytes value per record for the output
topic. Such a list is kept as it is (:func:`bytes_values`) and produced
straight through confluent-kafka (:func:`produce_values`) rather than as a
:data:`~kafkatx.outputs.PendingOutput` tuple each, made and unpacked again:
per record, that cost as much as the rest of the batch's handling. Anything
else a call returns or ``send()``\\ s is encoded first (a bad output fails the
call before anything of it is produced) and produced by
:func:`~kafkatx.result_emitters.produce_in_order`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kafkatx.listener.host import UnitProducer, UnitTransaction
from kafkatx.outputs import PendingOutput
from kafkatx.result_emitters import REFUSED, Produce, produce_in_order

__all__ = ["CallOutputs", "SendBuffer", "bytes_values", "produce_call_outputs", "produce_values"]

#: A call's outputs: what it sent and returned, encoded; and, when it returned a list of bytes for the output topic,
#: those values as they are (produced after what it sent).
CallOutputs = tuple[list[PendingOutput], list[bytes]]


class SendBuffer(list[PendingOutput]):
    """``kafkatx.send()``'s target during one call: kept only if the call returns."""

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


def bytes_values(result: Any) -> list[bytes] | None:
    """``result`` itself if it is a list of bytes, else None (it is then encoded item by item)."""
    if type(result) is not list:
        return None
    for item in result:
        if type(item) is not bytes:
            return None
    return result


def produce_values(
    values: list[bytes], topic: str, direct: Callable[[str], Produce | None], produce: Callable[[Any], None]
) -> int:
    """Produce ``values`` (bytes, no key) to ``topic`` in order; returns how many went straight to confluent-kafka
    (the others, refused, went through ``produce``, which waits for queue space or classifies the error, in their
    place: as :func:`~kafkatx.result_emitters.produce_in_order` does)."""
    fast = direct(topic)
    refused = 0
    for value in values:
        if fast is not None:
            try:
                fast(topic, value)
                continue
            except REFUSED:
                pass  # produce() waits for queue space, or classifies the error
        produce((topic, value, None, None, None))
        refused += 1
    return len(values) - refused


class _ProducingUnit(UnitTransaction, UnitProducer, Protocol):
    """What producing a call's outputs uses of the unit."""


def produce_call_outputs(unit: _ProducingUnit, outputs: CallOutputs, topic: str | None) -> None:
    """Produce a call's outputs in the open transaction, in order: what it sent, then what it returned (its
    values go to ``topic``, the listener's output topic)."""
    pending, values = outputs
    if pending:
        unit.outputs += produce_in_order(pending, unit.direct, unit.produce)
    if values and topic is not None:
        unit.outputs += produce_values(values, topic, unit.direct, unit.produce)
