"""One check for integer options, shared by every layer (it imports nothing from kafkatx).

``True`` is an ``int`` to Python, so ``max_attempts=True`` would pass ``isinstance(x, int)``;
every integer option of kafkatx refuses bools the same way. Callers raise their own error,
naming the option.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["is_int"]


def is_int(value: object, minimum: int | None = None, maximum: int | None = None) -> TypeGuard[int]:
    """True for an int that is not a bool, within ``minimum``..``maximum`` (each bound optional, inclusive)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
