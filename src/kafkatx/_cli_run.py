"""``kafkatx run module:attr``: placeholder until the container lands."""
from __future__ import annotations
import argparse
from typing import Any

def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="run an App")
    r.add_argument("target")
    r.set_defaults(func=lambda a: 2)
