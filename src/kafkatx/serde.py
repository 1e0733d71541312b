"""Typed records: a listener's ``value_type=`` / ``key_type=`` / ``deserializer=`` / ``key_deserializer=``.

:func:`typed_handler` wraps a handler so that each record's key and value
are decoded before it runs. A record that cannot be decoded raises a
:class:`~kafkatx.DecodeError` before the handler is called; the listener's
failure policy never retries one, so it goes to the recoverer at its first
delivery, with its bytes untouched (``Record.raw_key`` / ``raw_value``).

Decoding always starts from the raw bytes, so a record handled again (a
batch-mate re-run after a rollback, an in-place retry) decodes the same way.

What counts as "cannot be decoded": whatever the deserializer or validator
raises, except errors that are not the record's fault. An ``OSError``
(``ConnectionError``, ``TimeoutError``) propagates as it is (the listener's
``outages`` rule pauses it on a ``ConnectionError``); an HTTP client's
transport error and a Schema Registry answer other than a 4xx (the registry
failing is not the record being bad) become a
:class:`~kafkatx.DependencyUnavailable`: the listener pauses until the
service answers, and nothing is counted against the record.

pydantic (``kafkatx[pydantic]``) validates ``value_type=``; confluent-kafka's
Schema Registry serdes (``kafkatx[avro]``, ``[protobuf]``, ``[jsonschema]``)
are accepted as they are: they take a ``SerializationContext`` (topic,
key or value, headers), which kafkatx builds per record.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from confluent_kafka.serialization import Deserializer, MessageField, SerializationContext
from confluent_kafka.serialization import Serializer as ConfluentSerializer

from kafkatx.errors import DecodeError, DependencyUnavailable, InvalidConfigurationError
from kafkatx.outputs import serialize
from kafkatx.record import Output, Record

__all__ = [
    "TypedDecoding",
    "typed_decoding",
    "typed_handler",
    "output_serializer",
    "RegistrySerializer",
    "registry_handler",
    "json_serializer",
    "is_about_the_record",
]

Part = Literal["key", "value"]
#: Decodes one key or value: ``(raw bytes, record) -> object``; raises what the decoder raised.
PartDecoder = Callable[[bytes | None, Record], Any]


def _pydantic() -> Any:
    """pydantic, or a clear error naming the extra that brings it."""
    try:
        import pydantic
    except ImportError as exc:
        raise InvalidConfigurationError(
            f"value_type= and key_type= validate with pydantic: pip install 'kafkatx[pydantic]' ({exc})"
        ) from exc
    return pydantic


def _field_of(exc: BaseException) -> str | None:
    """The path of the first field pydantic says failed (``items.0.sku``), or None."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return None
    try:
        first = errors()[0]
    except Exception:  # noqa: BLE001 - not pydantic's ValidationError after all
        return None
    loc = first.get("loc") if isinstance(first, dict) else None
    return ".".join(str(p) for p in loc) if loc else None


def _first_error(exc: BaseException) -> str:
    """pydantic's first error in one line (``amount: Input should be a valid number [type=float_parsing]``)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            items = errors()
            first = items[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
            return f"{loc + ': ' if loc else ''}{first.get('msg')} [type={first.get('type')}]{more}"
        except Exception:  # noqa: BLE001 - fall back to the exception's own text
            pass
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def is_about_the_record(exc: BaseException) -> bool:
    """True if ``exc`` from a deserializer means the record's bytes are bad (not that a service is down)."""
    if isinstance(exc, OSError):
        return False
    status = getattr(exc, "http_status_code", None)
    if isinstance(status, int) and type(exc).__name__ == "SchemaRegistryError":
        return 400 <= status < 500
    module = type(exc).__module__
    return not module.startswith(("httpx", "httpcore"))


@dataclasses.dataclass(frozen=True, slots=True)
class TypedDecoding:
    """How a listener's records are decoded: one decoder per part, None for bytes as consumed."""

    key: PartDecoder | None
    value: PartDecoder | None
    #: For messages: ``Order``, ``AvroDeserializer``...
    key_label: str = ""
    value_label: str = ""
    #: ``value_type=`` alone, from JSON: pydantic's ``validate_json`` (the hot path calls it directly).
    value_json: Callable[[bytes], Any] | None = None

    def decode(self, record: Record) -> None:
        """Set ``record.key`` / ``record.value`` to the decoded objects; raise DecodeError, bytes left as they were."""
        key, value = record.key, record.value
        if self.key is not None:
            key = self._part(self.key, "key", self.key_label, record.raw_key, record)
        if self.value is not None:
            value = self._part(self.value, "value", self.value_label, record.raw_value, record)
        record.key, record.value = key, value

    @staticmethod
    def _part(decoder: PartDecoder, part: Part, label: str, raw: bytes | None, record: Record) -> Any:
        failure: Exception | None = None
        try:
            return decoder(raw, record)
        except OSError:
            raise  # ConnectionError, TimeoutError: the listener's outages= rule decides
        except Exception as exc:
            failure = exc
        if not is_about_the_record(failure):  # the registry or its transport failing: an outage, not the record
            raise DependencyUnavailable(
                f"the {part} deserializer of {record.coordinates} could not reach its service: "
                f"{type(failure).__name__}: {failure}"
            ) from failure
        raise _decode_error(failure, part, label, record) from failure  # outside the except: no chained context


def _decode_error(exc: Exception, part: Part, label: str, record: Record) -> DecodeError:
    as_what = f" as {label}" if label else ""
    return DecodeError(
        f"cannot decode the {part} of {record.coordinates}{as_what}: {_first_error(exc)}",
        part=part,
        field=_field_of(exc),
    )


def _label(kind: Any) -> str:
    return getattr(kind, "__qualname__", None) or getattr(kind, "__name__", None) or repr(kind)


def _part_decoder(part: Part, kind: Any, deserializer: Any, name: str) -> tuple[PartDecoder | None, str]:
    """The decoder of one part, from its type and/or deserializer (both: deserialize, then validate)."""
    if kind is None and deserializer is None:
        return None, ""
    deserialize = _deserializer_decoder(part, deserializer, name)
    if kind is None:
        assert deserialize is not None
        return deserialize, _label(type(deserializer))
    return _validating_decoder(part, kind, deserialize), _label(kind)


def _deserializer_decoder(part: Part, deserializer: Any, name: str) -> PartDecoder | None:
    """The deserializer as a ``(raw, record)`` decoder, None without one: confluent-kafka's take a
    SerializationContext, a plain callable only the bytes, and the decoder calls both alike."""
    if isinstance(deserializer, Deserializer):  # confluent-kafka's: (bytes, SerializationContext) -> object
        confluent = deserializer
        field = MessageField.KEY if part == "key" else MessageField.VALUE

        def deserialize(raw: bytes | None, record: Record) -> Any:
            headers: list[tuple[str, str | bytes | None]] = list(record.headers)
            return confluent(raw, SerializationContext(record.topic, field, headers))

        return deserialize
    if deserializer is None:
        return None
    if not callable(deserializer):
        raise InvalidConfigurationError(f"{name} must be callable (bytes -> object), got {deserializer!r}")
    plain = deserializer

    def deserialize_plain(raw: bytes | None, record: Record) -> Any:
        return plain(raw)

    return deserialize_plain


def _validating_decoder(part: Part, kind: Any, deserialize: PartDecoder | None) -> PartDecoder:
    """The decoder that validates ``kind`` with pydantic: of what ``deserialize`` made, or else of the bytes
    themselves (JSON; UTF-8 text for ``str``, so that b"abc" is the key "abc", not a JSON string)."""
    adapter = _adapter(kind, part)
    if deserialize is None and kind is str:
        validate_str = adapter.validate_python

        def from_text(raw: bytes | None, record: Record) -> Any:
            return validate_str(None if raw is None else raw.decode("utf-8"))

        return from_text
    if deserialize is None:
        validate_json, validate_python = adapter.validate_json, adapter.validate_python

        def from_json(raw: bytes | None, record: Record) -> Any:
            return validate_python(None) if raw is None else validate_json(raw)

        return from_json
    validate = adapter.validate_python
    inner = deserialize

    def deserialize_then_validate(raw: bytes | None, record: Record) -> Any:
        return validate(inner(raw, record))

    return deserialize_then_validate


def _adapter(kind: Any, part: Part) -> Any:
    pydantic = _pydantic()
    try:
        return pydantic.TypeAdapter(kind)
    except Exception as exc:
        raise InvalidConfigurationError(f"{part}_type={kind!r} is not a type pydantic can validate: {exc}") from exc


def typed_decoding(
    value_type: Any = None, key_type: Any = None, deserializer: Any = None, key_deserializer: Any = None
) -> TypedDecoding | None:
    """The listener's decoding, or None when it takes bytes (nothing declared)."""
    value, value_label = _part_decoder("value", value_type, deserializer, "deserializer")
    key, key_label = _part_decoder("key", key_type, key_deserializer, "key_deserializer")
    if key is None and value is None:
        return None
    json_only = value_type is not None and value_type is not str and deserializer is None
    value_json = _adapter(value_type, "value").validate_json if json_only else None
    return TypedDecoding(key, value, key_label, value_label, value_json)


def typed_handler(handler: Callable[[Record], Any], decoding: TypedDecoding) -> Callable[[Record], Any]:
    """``handler``, called with the record decoded; a DecodeError instead when it cannot be."""
    decode = decoding.decode
    validate_json = decoding.value_json
    wrapped: Callable[[Record], Any]
    if decoding.key is None and validate_json is not None:  # the usual declaration: pydantic's parser, directly

        def handle_json(record: Record) -> Any:
            try:
                record.value = validate_json(record.raw_value)  # type: ignore[arg-type]  # None fails: decode() says why
                decoded = True
            except Exception:
                decoded = False
            if not decoded:  # outside the except block: decode() raises the DecodeError, chained to its cause only
                decode(record)
            return handler(record)

        wrapped = handle_json
    else:

        def handle(record: Record) -> Any:
            decode(record)
            return handler(record)

        wrapped = handle
    functools.update_wrapper(wrapped, handler)
    return wrapped


def json_serializer(obj: Any) -> bytes:
    """JSON, by pydantic: models, dataclasses, dicts, lists, datetimes... (a typed listener's default)."""
    import pydantic_core

    data: bytes = pydantic_core.to_json(obj)
    return data


def _as_dict(obj: Any) -> Any:
    """A pydantic model or dataclass as a dict (what confluent-kafka's Schema Registry serializers take)."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def output_serializer(serializer: Any, typed: bool, topic: str | None) -> Callable[[Any], bytes] | None:
    """The listener's serializer: ``serializer=`` as given, confluent-kafka's with a context, or JSON if typed.

    confluent-kafka's serializers need the topic (their subject names come
    from it): it becomes a :class:`RegistrySerializer`, which gives them the
    topic each record is produced to.
    """
    if isinstance(serializer, ConfluentSerializer):
        return RegistrySerializer(serializer, topic)
    if serializer is None and typed:
        return json_serializer
    return serializer  # type: ignore[no-any-return]


class RegistrySerializer:
    """confluent-kafka's serializer, told the topic and part (key or value) of each record it encodes.

    A Schema Registry serializer names its subject after both (with the
    default TopicNameStrategy, ``<topic>-value`` / ``<topic>-key``), so an
    object sent to another topic than the listener's ``output``, or used as
    a key, must be encoded for that topic and part: :meth:`encode_result`
    encodes what a handler returns, :meth:`to` what ``send()`` produces.
    Called as a plain serializer, it encodes a value for the output topic.
    """

    __slots__ = ("_confluent", "_output")

    def __init__(self, confluent: ConfluentSerializer, output: str | None) -> None:
        self._confluent, self._output = confluent, output

    def __call__(self, obj: Any) -> bytes:
        return self.encode(obj, self._output, "value")

    def encode(self, obj: Any, topic: str | None, part: Part) -> bytes:
        """``obj`` as the ``part`` of a record produced to ``topic``."""
        if topic is None:
            raise InvalidConfigurationError(
                f"serializer={type(self._confluent).__name__} needs a topic for its subject name: declare output= "
                "on the listener, return Output(..., topic=...) or call send()"
            )
        field = MessageField.KEY if part == "key" else MessageField.VALUE
        data = self._confluent(_as_dict(obj), SerializationContext(topic, field))
        if data is None:
            raise ValueError(f"{type(self._confluent).__name__} encoded a {type(obj).__name__} as no bytes")
        return data

    def to(self, topic: str, part: Part) -> Callable[[Any], bytes]:
        """A serializer for the ``part`` of records produced to ``topic`` (what ``send()`` encodes with)."""
        return functools.partial(self._bound, topic=topic, part=part)

    def _bound(self, obj: Any, *, topic: str, part: Part) -> bytes:
        return self.encode(obj, topic, part)

    def encode_result(self, result: Any) -> Any:
        """A handler's return value with every object in it encoded for its destination (shapes kept)."""
        if result is None or isinstance(result, (bytes, str, bytearray, memoryview)) or inspect.isawaitable(result):
            return result  # nothing to encode; an awaitable from a plain def: the runner refuses it
        if isinstance(result, (Output, tuple)) or _is_one_value(result):
            return self._encode_item(result)
        if isinstance(result, list):
            return [self._encode_item(item) for item in result]
        return (self._encode_item(item) for item in result)  # a generator's items are produced as they come

    def _encode_item(self, item: Any) -> Any:
        """One output (not an iterable of them), as outputs.to_pending reads it, with bytes for objects."""
        if isinstance(item, Output):
            topic = item.topic or self._output
            if topic is None:
                return item  # outputs.py says what is missing
            return Output(
                value=self._part(item.value, topic, "value"),
                key=self._part(item.key, topic, "key"),
                topic=item.topic,
                headers=item.headers,
                partition=item.partition,
            )
        if self._output is None:
            return item
        if isinstance(item, tuple):
            if len(item) != 2:
                return item  # outputs.py says what is wrong with it
            key, value = item
            return self._part(key, self._output, "key"), self._part(value, self._output, "value")
        return self._part(item, self._output, "value")

    def _part(self, obj: Any, topic: str, part: Part) -> Any:
        if obj is None or isinstance(obj, (bytes, str, bytearray, memoryview)):
            return obj
        return serialize(obj, part, self.to(topic, part))  # its failure: the OutputError of any serializer


def _is_one_value(result: Any) -> bool:
    """A returned object that is one value, not an iterable of outputs (as outputs.collect_outputs decides)."""
    return not isinstance(result, Iterable) or isinstance(result, Mapping) or hasattr(result, "model_dump_json")


def registry_handler(handler: Callable[[Any], Any], serializer: RegistrySerializer, is_async: bool) -> Any:
    """``handler``, returning its outputs encoded for the topic each goes to (see :class:`RegistrySerializer`)."""
    encode_result = serializer.encode_result
    wrapped: Callable[[Any], Any]
    if is_async:

        async def handle_async(arg: Any) -> Any:
            return encode_result(await handler(arg))

        wrapped = handle_async
    else:

        def handle(arg: Any) -> Any:
            return encode_result(handler(arg))

        wrapped = handle
    functools.update_wrapper(wrapped, handler)
    return wrapped
