"""Shared test settings. The broker fixtures come from kafkatx's own pytest plugin."""

from __future__ import annotations

import logging

logging.getLogger("kafkatx").setLevel(logging.DEBUG)
