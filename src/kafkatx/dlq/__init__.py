"""Dead-letter topics: Spring-compatible headers, the publishing recoverer, and the inspect/replay tools.

The tools (``inspect_dlq``, ``replay_dlq`` and their types) load on first
use: an application that only publishes to a dead-letter topic does not pay
for importing them at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kafkatx.dlq.tools import DeadLetterEntry, DlqToolError, ReplayResult, inspect_dlq, replay_dlq

__all__ = ["DeadLetterEntry", "DlqToolError", "ReplayResult", "inspect_dlq", "replay_dlq"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kafkatx.dlq import tools

        return getattr(tools, name)
    raise AttributeError(f"module 'kafkatx.dlq' has no attribute {name!r}")
