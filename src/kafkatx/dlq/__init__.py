"""Dead-letter topics: Spring-compatible headers, the publishing recoverer, and the inspect/replay tools."""

from kafkatx.dlq.tools import DeadLetterEntry, DlqToolError, ReplayResult, inspect_dlq, replay_dlq

__all__ = ["DeadLetterEntry", "DlqToolError", "ReplayResult", "inspect_dlq", "replay_dlq"]
