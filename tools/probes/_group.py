"""Run group members as subprocesses (tools/probes/_member.py) and watch who owns what."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MEMBER = str(Path(__file__).resolve().parent / "_member.py")


@dataclass
class Member:
    name: str
    proc: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def owned(self) -> list[int]:
        for e in reversed(self.events):
            if e["event"] == "owned":
                return list(e["partitions"])
        return []

    def kill(self) -> float:
        t = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return t

    def term(self) -> float:
        t = time.time()
        self.proc.send_signal(signal.SIGTERM)
        return t

    def events_after(self, t: float, kinds: tuple[str, ...] = ("assign", "revoke", "lost")) -> list[dict[str, Any]]:
        return [e for e in self.events if e["t"] >= t and e["event"] in kinds]


class Group:
    """Members of one consumer group; every member's events, in one place."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.bootstrap, self.group, self.topic = bootstrap, group, topic
        self.members: dict[str, Member] = {}
        self._lock = threading.Lock()

    def start(
        self,
        name: str,
        instance_id: str | None = None,
        config: dict[str, Any] | None = None,
        close_after: float | None = None,
    ) -> Member:
        args = {
            "bootstrap": self.bootstrap,
            "group": self.group,
            "topic": self.topic,
            "name": name,
            "instance_id": instance_id,
            "config": config or {},
            "close_after": close_after,
        }
        proc = subprocess.Popen(
            [sys.executable, MEMBER, json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        member = Member(name, proc)
        self.members[name] = member
        threading.Thread(target=self._read, args=(member,), daemon=True).start()
        return member

    def _read(self, member: Member) -> None:
        assert member.proc.stdout is not None
        for line in member.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                member.events.append(event)

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    def ownership(self) -> dict[str, list[int]]:
        return {m.name: m.owned() for m in self.live()}

    def overlap(self) -> list[int]:
        seen: dict[int, int] = {}
        for parts in self.ownership().values():
            for p in parts:
                seen[p] = seen.get(p, 0) + 1
        return sorted(p for p, n in seen.items() if n > 1)

    def wait(self, cond: Callable[[], bool], timeout: float) -> float | None:
        """Wall time at which cond() first held, or None after timeout. Also records overlaps seen."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return time.time()
            self.note_overlap()
            time.sleep(0.02)
        return None

    overlaps: list[tuple[float, list[int]]]

    def note_overlap(self) -> None:
        if not hasattr(self, "overlaps"):
            self.overlaps = []
        o = self.overlap()
        if o:
            self.overlaps.append((time.time(), o))

    def watch(self, seconds: float) -> None:
        self.wait(lambda: False, seconds)

    def stop(self) -> None:
        for m in self.members.values():
            if m.alive:
                m.proc.send_signal(signal.SIGKILL)
                m.proc.wait()

    def stable(self, partitions: int, names: list[str]) -> bool:
        own = self.ownership()
        if set(own) != set(names):
            return False
        got = sorted(p for n in names for p in own[n])
        return got == list(range(partitions)) and all(own[n] for n in names)
