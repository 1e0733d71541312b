"""What an operator should check for each Kafka error code, and the default error message.

A kafkatx Kafka error names the code, the call that failed, librdkafka's
reason, what to check, and what kafkatx does about it, so that the cause can
be fixed from the message alone.
"""

from __future__ import annotations

from typing import Final

from confluent_kafka import KafkaError

from kafkatx.errors.classification import ErrorClass

__all__ = ["describe", "label", "sentence"]

_AUTHN_HINT = (
    "check security.protocol, sasl.mechanism and the credentials "
    "(sasl.username/sasl.password or the OAUTHBEARER settings)"
)
_FENCED_HINT = (
    "another producer with the same transactional.id has started (is the id unique per instance?), "
    "or this transaction outlived transaction.timeout.ms and the coordinator bumped the epoch"
)
_GROUP_HINT = (
    "the consumer lost its group membership (a rebalance, max.poll.interval.ms exceeded, "
    "or another member with the same group.instance.id)"
)
_VERSION_HINT = (
    "check the broker version: transactions need Kafka >= 0.11, and offsets sent with consumer group "
    "metadata (KIP-447) need >= 2.5; check api.version.request / broker.version.fallback too"
)
_HINTS: Final[dict[int, str]] = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: (
        "check the topic ACLs: the principal needs WRITE on every output topic (and the DLT) "
        "and READ/DESCRIBE on the input topics"
    ),
    KafkaError.GROUP_AUTHORIZATION_FAILED: (
        "check the group ACLs: the principal needs READ on the consumer group, which send_offsets_to_transaction uses"
    ),
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: (
        "check the cluster ACLs: brokers older than 2.8 require IDEMPOTENT_WRITE on the Cluster "
        "resource for idempotent and transactional producers"
    ),
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: (
        "check the transactional-id ACLs: the principal needs WRITE and DESCRIBE on the TransactionalId "
        "resource (a PREFIXED ACL on the listener's transactional.id prefix)"
    ),
    KafkaError.SASL_AUTHENTICATION_FAILED: _AUTHN_HINT,
    KafkaError._AUTHENTICATION: _AUTHN_HINT,
    KafkaError.UNSUPPORTED_SASL_MECHANISM: "check sasl.mechanism against the broker listener's sasl.enabled.mechanisms",
    KafkaError.ILLEGAL_SASL_STATE: _AUTHN_HINT,
    KafkaError._SSL: (
        "check security.protocol, ssl.ca.location, ssl.certificate.location/ssl.key.location, "
        "certificate validity and the broker host name (ssl.endpoint.identification.algorithm)"
    ),
    KafkaError.UNSUPPORTED_VERSION: _VERSION_HINT,
    KafkaError._UNSUPPORTED_FEATURE: _VERSION_HINT,
    KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT: (
        "the topic uses a message format older than v2 (Kafka 0.11); "
        "check the topic's message.format.version and the broker version"
    ),
    KafkaError.MSG_SIZE_TOO_LARGE: (
        "a record is larger than a size limit: raise the producer's message.max.bytes and the topic's "
        "max.message.bytes (broker default: message.max.bytes), or make the record smaller"
    ),
    KafkaError.RECORD_LIST_TOO_LARGE: (
        "a batch is larger than the topic's segment.bytes (broker log.segment.bytes); "
        "lower the producer's batch.size / message.max.bytes or raise segment.bytes"
    ),
    KafkaError.INVALID_RECORD: (
        "the broker rejected a record: e.g. a compacted topic (cleanup.policy=compact) needs a non-null key, "
        "or a broker-side record validation policy failed"
    ),
    KafkaError.INVALID_REQUIRED_ACKS: "transactional producers need acks=all; check the producer's acks setting",
    KafkaError.TOPIC_EXCEPTION: "a topic name is invalid: use only letters, digits, '.', '_' and '-' (at most 249 characters)",
    KafkaError.INVALID_TRANSACTION_TIMEOUT: (
        "transaction.timeout.ms is larger than the broker's transaction.max.timeout.ms (default 900000); "
        "lower it or raise the broker setting"
    ),
    KafkaError.INVALID_REPLICATION_FACTOR: (
        "a topic's replication factor is larger than the number of brokers; "
        "check the replication factor of topics kafkatx creates (e.g. the DLT)"
    ),
    KafkaError._INVALID_ARG: "an invalid argument or client setting reached confluent-kafka; check the producer/consumer configuration",
    KafkaError._UNKNOWN_TOPIC: (
        "the topic does not exist: create it (or enable auto.create.topics.enable on the broker) "
        "and check the topic names in the listener configuration"
    ),
    KafkaError._FENCED: _FENCED_HINT,
    KafkaError.PRODUCER_FENCED: _FENCED_HINT,
    KafkaError.INVALID_PRODUCER_EPOCH: _FENCED_HINT,
    KafkaError.INVALID_PRODUCER_ID_MAPPING: (
        "the transaction coordinator no longer knows this transactional.id "
        "(it expired after transactional.id.expiration.ms without use)"
    ),
    KafkaError.ILLEGAL_GENERATION: _GROUP_HINT,
    KafkaError.UNKNOWN_MEMBER_ID: _GROUP_HINT,
    KafkaError.FENCED_INSTANCE_ID: _GROUP_HINT,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER: (
        "the broker lost track of this producer's sequence numbers "
        "(for example after an unclean leader election); check the broker logs for data loss"
    ),
    KafkaError._INCONSISTENT: "some records of the transaction failed delivery; their delivery reports say why",
    KafkaError._MSG_TIMED_OUT: "a record was not delivered within message.timeout.ms; check broker availability",
    KafkaError.UNKNOWN_PRODUCER_ID: (
        "the broker no longer has this producer's state (its records may have been deleted by retention)"
    ),
    KafkaError.TRANSACTION_ABORTABLE: "the broker asked for the transaction to be aborted",
}


def label(error_class: ErrorClass) -> str:
    return error_class.value.replace("_", " ")


def sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else text + "."


def describe(error: KafkaError | None, error_class: ErrorClass, operation: str | None) -> str:
    """The default message: code name, operation, librdkafka's reason, what to check, what kafkatx does."""
    where = f" in {operation}" if operation else ""
    tail = f"[{label(error_class)}: {error_class.reaction}]"
    if error is None:
        return f"{sentence(label(error_class) + ' error' + where)} {tail}"
    parts = [sentence(f"{error.name()}{where}: {error.str()}")]
    hint = _HINTS.get(error.code())
    if hint:
        parts.append(sentence(hint))
    parts.append(tail)
    return " ".join(parts)
