"""Experiment: a TCP proxy in front of noida-db that empties the aborted-transactions list.

    python tools/probes/noida_fetch_proxy.py check     # the live-consumer scenario, direct vs through the proxy
    python tools/probes/noida_fetch_proxy.py serve     # a LocalBroker behind the proxy, until Ctrl-C; then e.g.
    pytest tests/test_chained_listeners.py --kafka-bootstrap 127.0.0.1:PORT

Not used by kafkatx. It tests the diagnosis in docs/BROKERS.md: noida lists
every aborted transaction of a partition in every read_committed
FetchResponse, also those whose ABORT marker lies before the fetch offset,
and librdkafka then drops all later records of that producer; if the
diagnosis is right, a consumer that reads through this proxy (list emptied,
everything else byte for byte) loses nothing.

Not safe as a stand-in for a Kafka broker: noida does not always leave
aborted records out of a read_committed response, and the list is then what
keeps them out. Read through this proxy, a retry topic written by copiers
that were killed mid-transaction returned 300 aborted records that a direct
read leaves out (docs/BROKERS.md).

The proxy rewrites Fetch responses v4-v13 (v12+ are flexible versions) and
passes every other byte through; it is bench/kafka_proxy.py's wire proxy
(which keeps clients on it) with a Fetch rewrite.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from kafka_proxy import KafkaProxy, _put_uvarint, _Rewriter, _skip_tags, _uvarint  # noqa: E402

FETCH = 1


def rewrite_fetch(body: bytes, version: int) -> bytes:
    """Fetch response body (after the correlation id) with every aborted_transactions list emptied."""
    flexible = version >= 12
    r = _Rewriter(body)
    f = r.f
    if flexible:
        _skip_tags(f)  # response header v1 tagged fields
    f.read(4)  # throttle_time_ms
    if version >= 7:
        f.read(6)  # error_code, session_id
    n_topics = _uvarint(f) - 1 if flexible else struct.unpack(">i", f.read(4))[0]
    for _ in range(max(n_topics, 0)):
        if version >= 13:
            f.read(16)  # topic_id
        elif flexible:
            f.read(_uvarint(f) - 1)
        else:
            f.read(struct.unpack(">h", f.read(2))[0])
        n_parts = _uvarint(f) - 1 if flexible else struct.unpack(">i", f.read(4))[0]
        for _ in range(max(n_parts, 0)):
            f.read(4 + 2 + 8 + 8)  # partition, error, high_watermark, last_stable_offset
            if version >= 5:
                f.read(8)  # log_start_offset
            start = f.tell()
            if flexible:
                n = _uvarint(f) - 1
                for _ in range(max(n, 0)):
                    f.read(16)
                    _skip_tags(f)
                r.replace_from(start, _put_uvarint(1) if n >= 0 else _put_uvarint(0))
            else:
                (n,) = struct.unpack(">i", f.read(4))
                f.read(16 * max(n, 0))
                r.replace_from(start, struct.pack(">i", 0 if n >= 0 else -1))
            if version >= 11:
                f.read(4)  # preferred_read_replica
            if flexible:
                f.read(max(_uvarint(f) - 1, 0))
                _skip_tags(f)
            else:
                f.read(max(struct.unpack(">i", f.read(4))[0], 0))
        if flexible:
            _skip_tags(f)
    return r.finish()


def _rewrite_fetch_response(api: int, version: int, body: bytes) -> bytes:
    return rewrite_fetch(body, version) if api == FETCH and 4 <= version <= 13 else body


def fetch_proxy(broker_port: int) -> KafkaProxy:
    """The wire proxy with every read_committed Fetch response's aborted-transactions list emptied."""
    return KafkaProxy(broker_port, on_response=_rewrite_fetch_response)


def _check() -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import noida_read_committed_skip as skip
    from confluent_kafka.admin import AdminClient

    from kafkatx.local import LocalBroker

    with LocalBroker() as broker:
        proxy = fetch_proxy(broker.port).start()
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers, "log_level": 0})
        bs = broker.bootstrap_servers
        producer, other = skip.txn_producer(bs, "probe-a"), skip.txn_producer(bs, "probe-b")
        for label, consumer_bs in (("direct", bs), ("through the proxy", proxy.bootstrap_servers)):
            lost = 0
            for _ in range(10):
                expected, received = skip.live_run(consumer_bs, admin, producer, other, {})
                lost += expected - received
            print(f"{label:<18}: {lost} of 40 committed records after an abort lost")
        proxy.stop()


def _serve() -> None:
    import signal

    from kafkatx.local import LocalBroker

    with LocalBroker() as broker:
        proxy = fetch_proxy(broker.port).start()
        print(f"noida-db at {broker.bootstrap_servers}, through the proxy at {proxy.bootstrap_servers}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        proxy.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        _check()
    elif sys.argv[1:] == ["serve"]:
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        _serve()
    else:
        sys.exit(__doc__)
