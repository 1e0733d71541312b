"""LocalBroker: lifecycle, data kept across restarts, no orphan processes, clear errors."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from kafkatx.local import LocalBroker, LocalBrokerError, PortInUseError
from kafkatx.testing import create_topic, produce, read_topic, wait_for

pytestmark = pytest.mark.local_broker_only


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child still "exists" until reaped; treat Z state as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_start_stop_restart_keeps_data_and_leaves_no_process(tmp_path: Path) -> None:
    broker = LocalBroker(data_dir=tmp_path / "data")
    with broker:
        pid = broker.pid
        assert pid and _alive(pid)
        topic = create_topic(broker.bootstrap_servers, partitions=3)
        produce(broker.bootstrap_servers, topic, [b"a", b"b", b"c"])
        address = broker.bootstrap_servers
        broker.restart()
        assert broker.bootstrap_servers == address, "restart keeps the port"
        assert broker.pid != pid and not _alive(pid)
        values = sorted(r.value for r in read_topic(broker.bootstrap_servers, topic))
        assert values == [b"a", b"b", b"c"]
        new_pid = broker.pid
    assert not broker.running
    assert new_pid is not None and not _alive(new_pid)
    assert (tmp_path / "data").is_dir(), "a caller-supplied data dir is kept"


def test_temporary_data_dir_is_removed_on_stop() -> None:
    broker = LocalBroker().start()
    data_dir = broker.data_dir
    assert data_dir.is_dir()
    broker.stop()
    broker.stop()  # idempotent
    assert not data_dir.exists()


def test_port_in_use_is_a_clear_error(kafka_broker: LocalBroker) -> None:
    with pytest.raises(LocalBrokerError, match=rf"port {kafka_broker.port} .* already in use") as raised:
        LocalBroker(port=kafka_broker.port).start()
    assert isinstance(raised.value, PortInUseError) and raised.value.port == kafka_broker.port
    assert "LocalBroker(port=None)" in str(raised.value), "Python words here; the commands say it with their options"
    assert "kafkatx" not in str(raised.value)


def test_unwritable_data_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(LocalBrokerError, match="cannot be written"):
        LocalBroker(data_dir=blocker / "data").start()


def test_missing_local_extra_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "noida_db" else real(name, *a))
    with pytest.raises(LocalBrokerError, match=r"pip install 'kafkatx\[local\]'"):
        LocalBroker().start()


def test_bad_port_rejected() -> None:
    with pytest.raises(LocalBrokerError, match="port must be"):
        LocalBroker(port=70000)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_orphan_when_the_owner_dies(tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A temporary directory of its own: a broker started meanwhile by another test (pytest -n 2) removes a dead
    # owner's directory from the shared one, which is the rule under test, but not this test's to see.
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    script = textwrap.dedent(
        """
        import sys
        from kafkatx.local import LocalBroker
        b = LocalBroker().start()
        print(b.pid, b.data_dir, flush=True)
        sys.stdin.readline()  # the owner lives until the test has seen its broker alive, then exits or is killed
        """
    )
    env = {**os.environ, "TMPDIR": str(private)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdin is not None and proc.stdout is not None
    pid_text, data_dir = proc.stdout.readline().split()
    assert Path(data_dir).parent == private
    broker_pid = int(pid_text)
    assert _alive(broker_pid)
    if how == "sigkill":
        proc.send_signal(signal.SIGKILL)
    else:
        proc.stdin.close()  # the owner exits on its own now
    proc.wait(30)
    proc.stdin.close()
    proc.stdout.close()
    wait_for(lambda: not _alive(broker_pid), timeout=15, message=f"broker pid {broker_pid} to exit")
    assert Path(data_dir).exists() == (how == "sigkill"), "a killed owner cleans nothing up itself"
    LocalBroker().start().stop()
    assert not Path(data_dir).exists(), "the next start removes a dead owner's temporary directory"


def test_kafkatx_broker_command_runs_in_foreground_and_stops_on_sigterm(tmp_path: Path) -> None:
    from kafkatx.local import _free_port

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kafkatx", "broker", "--port", str(port), "--data-dir", str(tmp_path / "b")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if f"127.0.0.1:{port}" in line or not line:
            break
    assert f"127.0.0.1:{port}" in line, line
    bootstrap = f"127.0.0.1:{port}"
    topic = create_topic(bootstrap)
    produce(bootstrap, topic, [b"hello"])
    assert [r.value for r in read_topic(bootstrap, topic)] == [b"hello"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    out = proc.stdout.read()
    assert "stopped" in out
    with pytest.raises(OSError):
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_failed_start_leaves_no_temporary_directory(tmp_path: Path) -> None:
    import glob
    import socket
    import tempfile

    pattern = str(Path(tempfile.gettempdir()) / "kafkatx-broker-*")
    before = set(glob.glob(pattern))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(LocalBrokerError, match="already in use"):
            LocalBroker(port=busy.getsockname()[1]).start()
    assert set(glob.glob(pattern)) == before
