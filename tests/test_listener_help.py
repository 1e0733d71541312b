"""``help(app.listener)`` documents every option and its default; the default back-off is the one documented."""

from __future__ import annotations

import pydoc
import re
import time

from helpers import make_app

from kafkatx import App, Record
from kafkatx.listener.options import LISTENER_DEFAULTS
from kafkatx.testing import KafkaTestKit, running, wait_for


def test_help_of_app_listener_lists_every_option_with_its_default() -> None:
    app = App("help", bootstrap_servers="127.0.0.1:9")
    text = pydoc.render_doc(app.listener, renderer=pydoc.plaintext)
    assert "see the README" not in text
    for option in LISTENER_DEFAULTS:
        assert re.search(rf"``{option}``( / ``\w+``)? \[", text) or re.search(rf"``\w+`` / ``{option}`` \[", text), (
            f"{option} is listed with its default"
        )
    assert "``backoff`` [1.0]" in text and "``max_attempts`` [3]" in text


def test_the_default_backoff_is_one_second_between_attempts(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"flaky"])
    app = make_app(kafka)
    attempts: list[float] = []

    @app.listener(src, output=out)
    def flaky(record: Record) -> bytes:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise RuntimeError("fails once")
        return b"ok"

    assert app.listeners[0].policy.decide(1, RuntimeError()).delay == 1.0
    with running(app):
        wait_for(lambda: kafka.values(out) == [b"ok"], 30)
    assert len(attempts) == 2
    assert 0.95 <= attempts[1] - attempts[0] < 5, "retried a second later, not at once"
