"""The kafkatx command's argument parser: an unknown option is refused with the closest one, and none is abbreviated.

argparse accepts ``--instance-i`` for ``--instance-id`` (a prefix that would
silently change meaning once another ``--instance-...`` option exists) and
answers a misspelt one with "unrecognized arguments" and exit 2, where
``kafkatx run`` documents 64 for a wrong argument. Built on argparse's public
API only: options are recorded as they are added, subcommands as their
groups are made.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from kafkatx._suggest import closest_name

__all__ = ["CommandParser"]


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser without abbreviations, whose usage errors exit ``usage_exit_code`` and name the closest
    option for an unknown one.

    Subparsers made by :meth:`add_subparsers` are CommandParsers too (argparse makes them of the parent's class).
    """

    def __init__(self, *args: Any, usage_exit_code: int = 2, **kwargs: Any) -> None:
        self.option_names: list[str] = []  # filled by add_argument, which argparse's __init__ calls for --help
        self.subcommand_groups: list[argparse.Action] = []
        self.usage_exit_code = usage_exit_code
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.option_names.extend(action.option_strings)
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        group = super().add_subparsers(**kwargs)
        self.subcommand_groups.append(group)
        return group

    def subcommands(self) -> list[CommandParser]:
        """The parsers of this parser's subcommands, each once (aliases share a parser)."""
        found = (parser for group in self.subcommand_groups for parser in dict(group.choices or {}).values())
        return [parser for parser in dict.fromkeys(found) if isinstance(parser, CommandParser)]

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        """Parse, refusing what this parser does not know.

        argparse parses a subcommand's arguments with the subparser's parse_known_args and lets the top parser
        report the leftovers, which then cannot name the subcommand's closest option: the subparser reports them.
        """
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(self._unrecognized(unknown))
        return parsed, unknown

    def _unrecognized(self, unknown: list[str]) -> str:
        message = f"unrecognized arguments: {' '.join(unknown)}"
        for arg in unknown:
            option = arg.partition("=")[0]
            if not option.startswith("-"):
                continue
            prefixed = [name for name in self.option_names if name.startswith(option)]
            if prefixed:
                return f"{message} (options are never abbreviated: did you mean {' or '.join(prefixed)}?)"
            long_names = {name.lstrip("-"): name for name in self.option_names}  # the dashes would match any
            close = closest_name(option.lstrip("-"), long_names)
            if close is not None:
                return f"{message} (did you mean {long_names[close]}?)"
        return message

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(self.usage_exit_code, f"{self.prog}: error: {message}\n")
