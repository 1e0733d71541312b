"""A Kafka wire proxy on 127.0.0.1 in front of one broker port: a network between client and broker.

    python bench/kafka_proxy.py serve --delay-ms 2   # a LocalBroker behind a 2 ms-each-way proxy, until Ctrl-C

On loopback a commit costs ~0.5 ms; on a real cluster it costs several
network round trips. ``delay`` holds every request and every response for
that long before passing it on (each way, in order, pipelined: throughput is
not capped, only latency added), so a benchmark can say what a user on a
real network gets.

Brokers advertise their own address in Metadata, so the proxy rewrites the
broker's port to its own in Metadata (v0-v12) and FindCoordinator (v0-v4)
responses, and clients stay on the proxy. ``on_response`` may rewrite any
other response (the noida Fetch probe in tools/probes uses it).
"""

from __future__ import annotations

import asyncio
import io
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

METADATA, FIND_COORDINATOR = 3, 10

#: A response rewrite: (api key, api version, body after the correlation id) -> new body.
ResponseHook = Callable[[int, int, bytes], bytes]


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


class KafkaProxy:
    """A proxy on 127.0.0.1 in front of ``broker_port``, in a background thread; ``delay`` seconds each way."""

    def __init__(self, broker_port: int, delay: float = 0.0, on_response: ResponseHook | None = None) -> None:
        self.broker_port = broker_port
        self.delay = delay
        self.on_response = on_response
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kafka-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> KafkaProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start within 10 s")
        return self

    def stop(self) -> None:
        """Close every connection, then the loop (quietly: no task is left pending)."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        # Cancel the connections' forwarding tasks only: each connection's own task then ends by itself
        # (cancelling it would make asyncio's stream server log the cancellation as an error).
        io_tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("proxy-io")]
        for t in io_tasks:
            t.cancel()
        await asyncio.gather(*io_tasks, return_exceptions=True)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)

    def __enter__(self) -> KafkaProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def _rewrite(self, api: int | None, version: int | None, msg: bytes) -> bytes:
        if api is None or version is None:
            return msg
        if api == FIND_COORDINATOR and version <= 4:
            return msg[:4] + rewrite_find_coordinator(msg[4:], version, self.broker_port, self.port)
        if api == METADATA and version <= 12:
            return msg[:4] + rewrite_metadata(msg[4:], version, self.broker_port, self.port)
        if self.on_response is not None:
            return msg[:4] + self.on_response(api, version, msg[4:])
        return msg

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            breader, bwriter = await asyncio.open_connection("127.0.0.1", self.broker_port)
        except OSError:
            cwriter.close()
            return
        pending: deque[tuple[int, int, int]] = deque()  # (correlation id, api key, api version) of requests

        async def read_requests(out: asyncio.Queue[tuple[float, bytes]]) -> None:
            while True:
                head = await creader.readexactly(4)
                msg = await creader.readexactly(struct.unpack(">i", head)[0])
                api, ver, corr = struct.unpack(">hhi", msg[:8])
                pending.append((corr, api, ver))
                out.put_nowait((time.monotonic() + self.delay, head + msg))

        async def read_responses(out: asyncio.Queue[tuple[float, bytes]]) -> None:
            while True:
                head = await breader.readexactly(4)
                msg = await breader.readexactly(struct.unpack(">i", head)[0])
                (corr,) = struct.unpack(">i", msg[:4])
                while pending and pending[0][0] != corr:
                    pending.popleft()
                api, ver = pending.popleft()[1:] if pending else (None, None)
                msg = self._rewrite(api, ver, msg)
                out.put_nowait((time.monotonic() + self.delay, struct.pack(">i", len(msg)) + msg))

        async def forward(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
            while True:
                due, frame = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(frame)
                if queue.empty():
                    await writer.drain()

        requests: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        responses: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        tasks = [
            asyncio.create_task(read_requests(requests), name="proxy-io-requests"),
            asyncio.create_task(forward(requests, bwriter), name="proxy-io-to-broker"),
            asyncio.create_task(read_responses(responses), name="proxy-io-responses"),
            asyncio.create_task(forward(responses, cwriter), name="proxy-io-to-client"),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            for w in (cwriter, bwriter):
                w.close()


def _serve(delay_ms: float) -> None:
    import signal

    from kafkatx.local import LocalBroker

    with LocalBroker() as broker, KafkaProxy(broker.port, delay_ms / 1000.0) as proxy:
        print(
            f"noida-db at {broker.bootstrap_servers}, through the proxy ({delay_ms:g} ms each way) at "
            f"{proxy.bootstrap_servers}",
            flush=True,
        )
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--delay-ms", type=float, default=2.0, help="delay each way (default 2)")
    cli = parser.parse_args()
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    _serve(cli.delay_ms)
    sys.exit(0)
