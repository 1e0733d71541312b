"""Experiment: a TCP proxy in front of noida-db that empties the aborted-transactions list.

    python tools/probes/noida_fetch_proxy.py check     # the live-consumer scenario, direct vs through the proxy
    python tools/probes/noida_fetch_proxy.py serve     # a LocalBroker behind the proxy, until Ctrl-C; then e.g.
    pytest tests/test_chained_listeners.py --kafka-bootstrap 127.0.0.1:PORT

Not used by kafkatx. It tests the diagnosis in docs/BROKERS.md: noida lists
every aborted transaction of a partition in every read_committed
FetchResponse, also those whose ABORT marker lies before the fetch offset,
and librdkafka then drops all later records of that producer. noida already
removes aborted records from read_committed responses itself, so the list
carries nothing a client needs; if the diagnosis is right, a consumer that
reads through this proxy (list emptied, everything else byte for byte)
loses nothing.

The proxy rewrites Fetch responses v4-v13 (v12+ are flexible versions) and
passes every other byte through. Brokers advertise their own address in
Metadata, so clients are pointed at the proxy with the broker's port
mapped: :class:`FetchProxy` also rewrites the port in Metadata (v0-v12)
and FindCoordinator (v0-v4) responses so that clients stay on the proxy.
"""

from __future__ import annotations

import asyncio
import io
import struct
import sys
import threading
from collections import deque

FETCH, METADATA, FIND_COORDINATOR = 1, 3, 10


def _uvarint(f: io.BytesIO) -> int:
    shift = value = 0
    while True:
        b = f.read(1)[0]
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value
        shift += 7


def _put_uvarint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _skip_tags(f: io.BytesIO) -> None:
    for _ in range(_uvarint(f)):
        _uvarint(f)
        f.read(_uvarint(f))


class _Rewriter:
    """Copies a response while replacing pieces of it."""

    def __init__(self, data: bytes) -> None:
        self.f = io.BytesIO(data)
        self.out = bytearray()
        self.mark = 0

    def copy_to_here(self) -> None:
        pos = self.f.tell()
        self.out += self.f.getbuffer()[self.mark : pos]
        self.mark = pos

    def replace_from(self, start: int, replacement: bytes) -> None:
        self.out += self.f.getbuffer()[self.mark : start]
        self.out += replacement
        self.mark = self.f.tell()

    def finish(self) -> bytes:
        self.out += self.f.getbuffer()[self.mark :]
        return bytes(self.out)


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


def rewrite_metadata(body: bytes, version: int, broker_port: int, proxy_port: int) -> bytes:
    """Metadata response with the broker's port replaced by the proxy's."""
    flexible = version >= 9
    r = _Rewriter(body)
    f = r.f
    if flexible:
        _skip_tags(f)
    if version >= 3:
        f.read(4)
    n = _uvarint(f) - 1 if flexible else struct.unpack(">i", f.read(4))[0]
    for _ in range(max(n, 0)):
        f.read(4)  # node_id
        f.read(_uvarint(f) - 1 if flexible else struct.unpack(">h", f.read(2))[0])  # host
        start = f.tell()
        (port,) = struct.unpack(">i", f.read(4))
        if port == broker_port:
            r.replace_from(start, struct.pack(">i", proxy_port))
        if version >= 1:  # rack
            if flexible:
                ln = _uvarint(f) - 1
            else:
                (ln,) = struct.unpack(">h", f.read(2))
            f.read(max(ln, 0))
        if flexible:
            _skip_tags(f)
    return r.finish()


def rewrite_find_coordinator(body: bytes, version: int, broker_port: int, proxy_port: int) -> bytes:
    """FindCoordinator response (v0-v4) with the broker's port replaced by the proxy's."""
    flexible = version >= 3
    r = _Rewriter(body)
    f = r.f

    def string() -> None:
        if flexible:
            f.read(max(_uvarint(f) - 1, 0))
        else:
            f.read(max(struct.unpack(">h", f.read(2))[0], 0))

    def node() -> None:
        f.read(4)  # node_id
        string()  # host
        start = f.tell()
        (port,) = struct.unpack(">i", f.read(4))
        if port == broker_port:
            r.replace_from(start, struct.pack(">i", proxy_port))

    if flexible:
        _skip_tags(f)
    if version >= 1:
        f.read(4)  # throttle_time_ms
    if version >= 4:
        for _ in range(_uvarint(f) - 1):
            string()  # key
            node()
            f.read(2)  # error_code
            string()  # error_message
            _skip_tags(f)
    else:
        f.read(2)  # error_code
        if version >= 1:
            string()  # error_message
        node()
    return r.finish()


class FetchProxy:
    """A proxy on 127.0.0.1 in front of one broker port, in a background thread."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port = broker_port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "FetchProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            breader, bwriter = await asyncio.open_connection("127.0.0.1", self.broker_port)
        except OSError:
            cwriter.close()
            return
        pending: deque[tuple[int, int, int]] = deque()

        async def upstream() -> None:
            while True:
                head = await creader.readexactly(4)
                msg = await creader.readexactly(struct.unpack(">i", head)[0])
                api, ver, corr = struct.unpack(">hhi", msg[:8])
                pending.append((corr, api, ver))
                bwriter.write(head + msg)
                await bwriter.drain()

        async def downstream() -> None:
            while True:
                head = await breader.readexactly(4)
                msg = await breader.readexactly(struct.unpack(">i", head)[0])
                (corr,) = struct.unpack(">i", msg[:4])
                while pending and pending[0][0] != corr:
                    pending.popleft()
                api, ver = pending.popleft()[1:] if pending else (None, None)
                if api == FETCH and ver is not None and 4 <= ver <= 13:
                    msg = msg[:4] + rewrite_fetch(msg[4:], ver)
                elif api == FIND_COORDINATOR and ver is not None and ver <= 4:
                    msg = msg[:4] + rewrite_find_coordinator(msg[4:], ver, self.broker_port, self.port)
                elif api == METADATA and ver is not None and ver <= 12:
                    msg = msg[:4] + rewrite_metadata(msg[4:], ver, self.broker_port, self.port)
                cwriter.write(struct.pack(">i", len(msg)) + msg)
                await cwriter.drain()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            for w in (cwriter, bwriter):
                w.close()


def _check() -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import noida_read_committed_skip as skip
    from confluent_kafka.admin import AdminClient

    from kafkatx.local import LocalBroker

    with LocalBroker() as broker:
        proxy = FetchProxy(broker.port).start()
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
        proxy = FetchProxy(broker.port).start()
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
