"""librdkafka's configuration property names, for a misspelt property's did-you-mean at declaration.

The list is librdkafka 2.16's (``rd_kafka_conf_properties_show``, the table
of its CONFIGURATION.md). A name missing from it is not refused on the list's
word alone: librdkafka itself is asked (a client created with just that
property), so a property of a newer librdkafka, or one of confluent-kafka's
own (``error_cb``, ``logger``...), passes. Only a name librdkafka does not
know is an error, raised where the App or listener declares it, so
``kafkatx run`` names that file and line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaException, Producer

from kafkatx._suggest import closest_name
from kafkatx.errors import InvalidConfigurationError

__all__ = ["LIBRDKAFKA_PROPERTIES", "check_property_names"]

LIBRDKAFKA_PROPERTIES: frozenset[str] = frozenset(
    (
        "acks",
        "allow.auto.create.topics",
        "api.version.fallback.ms",
        "api.version.request",
        "api.version.request.timeout.ms",
        "auto.commit.enable",
        "auto.commit.interval.ms",
        "auto.offset.reset",
        "background_event_cb",
        "batch.num.messages",
        "batch.size",
        "bootstrap.servers",
        "broker.address.family",
        "broker.address.ttl",
        "broker.version.fallback",
        "builtin.features",
        "check.crcs",
        "client.dns.lookup",
        "client.id",
        "client.rack",
        "closesocket_cb",
        "compression.codec",
        "compression.level",
        "compression.type",
        "connect_cb",
        "connections.max.idle.ms",
        "consume.callback.max.messages",
        "consume_cb",
        "coordinator.query.interval.ms",
        "debug",
        "default_topic_conf",
        "delivery.report.only.error",
        "delivery.timeout.ms",
        "dr_cb",
        "dr_msg_cb",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "enable.gapless.guarantee",
        "enable.idempotence",
        "enable.metrics.push",
        "enable.partition.eof",
        "enable.random.seed",
        "enable.sasl.oauthbearer.unsecure.jwt",
        "enable.ssl.certificate.verification",
        "enabled_events",
        "error_cb",
        "fetch.error.backoff.ms",
        "fetch.max.bytes",
        "fetch.message.max.bytes",
        "fetch.min.bytes",
        "fetch.queue.backoff.ms",
        "fetch.wait.max.ms",
        "group.id",
        "group.instance.id",
        "group.protocol",
        "group.protocol.type",
        "group.remote.assignor",
        "heartbeat.interval.ms",
        "https.ca.location",
        "https.ca.pem",
        "interceptors",
        "internal.termination.signal",
        "isolation.level",
        "linger.ms",
        "log.connection.close",
        "log.queue",
        "log.thread.name",
        "log_cb",
        "log_level",
        "max.in.flight",
        "max.in.flight.requests.per.connection",
        "max.partition.fetch.bytes",
        "max.poll.interval.ms",
        "max.poll.records",
        "message.copy.max.bytes",
        "message.max.bytes",
        "message.send.max.retries",
        "message.timeout.ms",
        "metadata.broker.list",
        "metadata.max.age.ms",
        "metadata.recovery.rebootstrap.trigger.ms",
        "metadata.recovery.strategy",
        "msg_order_cmp",
        "oauthbearer_token_refresh_cb",
        "offset.store.method",
        "offset.store.path",
        "offset.store.sync.interval.ms",
        "offset_commit_cb",
        "opaque",
        "open_cb",
        "partition.assignment.strategy",
        "partitioner",
        "partitioner_cb",
        "plugin.library.paths",
        "produce.offset.report",
        "queue.buffering.backpressure.threshold",
        "queue.buffering.max.kbytes",
        "queue.buffering.max.messages",
        "queue.buffering.max.ms",
        "queued.max.messages.kbytes",
        "queued.min.messages",
        "queuing.strategy",
        "rebalance_cb",
        "receive.message.max.bytes",
        "reconnect.backoff.jitter.ms",
        "reconnect.backoff.max.ms",
        "reconnect.backoff.ms",
        "request.required.acks",
        "request.timeout.ms",
        "resolve_cb",
        "retries",
        "retry.backoff.max.ms",
        "retry.backoff.ms",
        "sasl.kerberos.keytab",
        "sasl.kerberos.kinit.cmd",
        "sasl.kerberos.min.time.before.relogin",
        "sasl.kerberos.principal",
        "sasl.kerberos.service.name",
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.oauthbearer.assertion.algorithm",
        "sasl.oauthbearer.assertion.claim.aud",
        "sasl.oauthbearer.assertion.claim.exp.seconds",
        "sasl.oauthbearer.assertion.claim.iss",
        "sasl.oauthbearer.assertion.claim.jti.include",
        "sasl.oauthbearer.assertion.claim.nbf.seconds",
        "sasl.oauthbearer.assertion.claim.sub",
        "sasl.oauthbearer.assertion.file",
        "sasl.oauthbearer.assertion.jwt.template.file",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.client.credentials.client.id",
        "sasl.oauthbearer.client.credentials.client.secret",
        "sasl.oauthbearer.client.id",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.extensions",
        "sasl.oauthbearer.grant.type",
        "sasl.oauthbearer.metadata.authentication.type",
        "sasl.oauthbearer.method",
        "sasl.oauthbearer.scope",
        "sasl.oauthbearer.sub.claim.name",
        "sasl.oauthbearer.token.endpoint.url",
        "sasl.password",
        "sasl.username",
        "security.protocol",
        "session.timeout.ms",
        "share.acknowledgement.mode",
        "socket.blocking.max.ms",
        "socket.connection.setup.timeout.ms",
        "socket.keepalive.enable",
        "socket.max.fails",
        "socket.nagle.disable",
        "socket.receive.buffer.bytes",
        "socket.send.buffer.bytes",
        "socket.timeout.ms",
        "socket_cb",
        "ssl.ca.certificate.stores",
        "ssl.ca.location",
        "ssl.ca.pem",
        "ssl.certificate.location",
        "ssl.certificate.pem",
        "ssl.certificate.verify_cb",
        "ssl.cipher.suites",
        "ssl.crl.location",
        "ssl.curves.list",
        "ssl.endpoint.identification.algorithm",
        "ssl.engine.id",
        "ssl.engine.location",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl.keystore.location",
        "ssl.keystore.password",
        "ssl.providers",
        "ssl.sigalgs.list",
        "ssl_ca",
        "ssl_certificate",
        "ssl_engine_callback_data",
        "ssl_key",
        "statistics.interval.ms",
        "stats_cb",
        "sticky.partitioning.linger.ms",
        "throttle_cb",
        "topic.blacklist",
        "topic.metadata.propagation.max.ms",
        "topic.metadata.refresh.fast.cnt",
        "topic.metadata.refresh.fast.interval.ms",
        "topic.metadata.refresh.interval.ms",
        "topic.metadata.refresh.sparse",
        "transaction.timeout.ms",
        "transactional.id",
    )
)

#: confluent-kafka's own keys (callbacks), which librdkafka does not list.
_CLIENT_KEYS = frozenset({"error_cb", "logger", "oauth_cb", "on_commit", "on_delivery", "stats_cb", "throttle_cb"})

_UNKNOWN = "No such configuration property"


def check_property_names(what: str, config: Mapping[str, Any]) -> None:
    """Raise InvalidConfigurationError for a property of ``config`` librdkafka does not know, with the closest name.

    ``what`` names the option, e.g. ``"App consumer_config"``.
    """
    for name, value in config.items():
        if not isinstance(name, str) or name in LIBRDKAFKA_PROPERTIES or name in _CLIENT_KEYS:
            continue
        if not _unknown_to_librdkafka(name, value):
            continue
        close = closest_name(name, LIBRDKAFKA_PROPERTIES)
        hint = f"; did you mean {close!r}?" if close else " (see librdkafka's CONFIGURATION.md)"
        raise InvalidConfigurationError(f"{what}: no such librdkafka property {name!r}{hint}")


def _unknown_to_librdkafka(name: str, value: Any) -> bool:
    """librdkafka's own answer for a name missing from the list (rare: a typo, or a newer property)."""
    try:
        Producer({name: value, "log_level": 0})
    except KafkaException as exc:
        return _UNKNOWN in str(exc)
    except (TypeError, ValueError):
        return False  # a value confluent-kafka refuses: the startup check names it
    return False
