"""Shared test settings. The broker fixtures come from kafkatx's own pytest plugin."""

from __future__ import annotations

import logging

logging.getLogger("kafkatx").setLevel(logging.DEBUG)
# py4j logs from __del__ at interpreter exit, after pytest has closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)
