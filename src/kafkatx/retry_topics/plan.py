"""Which retry topic holds a record's n-th retry, and how long it waits there.

One topic per distinct delay, so that every record in a topic partition waits
the same time and the head of the partition is always the one due first: a
record due later never holds back one due earlier. The names follow Spring's
defaults, so that Java and Python services can share the topics:

- a fixed back-off (every retry waits the same): one topic, ``<topic>-retry``;
- otherwise one topic per delay in milliseconds, ``<topic>-retry-1000``,
  ``<topic>-retry-2000``...; retries with the same delay share its topic (an
  exponential back-off that reached its maximum);
- a back-off whose waits are random (jitter): one topic per attempt,
  ``<topic>-retry-0``, ``<topic>-retry-1``... (Spring's index suffix): the
  records of one topic then differ by at most the jitter.
"""

from __future__ import annotations

from dataclasses import dataclass

from kafkatx.rollback.policy import FailurePolicy

__all__ = ["RETRY_SUFFIX", "RetryLevel", "RetryTopicPlan"]

#: Spring's default retry-topic suffix.
RETRY_SUFFIX = "-retry"


@dataclass(frozen=True, slots=True)
class RetryLevel:
    """One retry topic's suffix (appended to the input topic) and the wait of the records in it."""

    suffix: str
    delay: float


class RetryTopicPlan:
    """The retry topics of a listener's failure policy: ``max_attempts - 1`` retries, each in a level."""

    def __init__(self, policy: FailurePolicy) -> None:
        retries = policy.max_attempts - 1
        delays = [policy.nominal_delay(attempt) for attempt in range(1, retries + 1)]
        jittered = any(policy.nominal_delay(attempt) != delay for attempt, delay in enumerate(delays, start=1))
        if jittered:
            levels = [RetryLevel(f"{RETRY_SUFFIX}-{i}", delay) for i, delay in enumerate(delays)]
        elif len(set(delays)) <= 1:
            levels = [RetryLevel(RETRY_SUFFIX, delay) for delay in delays]
        else:
            levels = [RetryLevel(f"{RETRY_SUFFIX}-{round(delay * 1000)}", delay) for delay in delays]
        #: The level of each retry: ``by_retry[0]`` holds the record for its second attempt.
        self.by_retry: tuple[RetryLevel, ...] = tuple(levels)

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The distinct retry-topic suffixes, in the order the retries use them."""
        return tuple(dict.fromkeys(level.suffix for level in self.by_retry))

    def topics(self, topic: str) -> tuple[str, ...]:
        """The retry topics of input topic ``topic``."""
        return tuple(topic + suffix for suffix in self.suffixes)

    def level_for(self, attempt: int) -> RetryLevel | None:
        """Where a record waits after its ``attempt``-th delivery failed; None once no retry is left."""
        if 1 <= attempt <= len(self.by_retry):
            return self.by_retry[attempt - 1]
        return None

    def origin_of(self, retry_topic: str, inputs: tuple[str, ...]) -> str | None:
        """The input topic whose retry topic ``retry_topic`` is, or None if it is none of theirs."""
        for topic in inputs:
            if retry_topic.startswith(topic) and retry_topic[len(topic) :] in self.suffixes:
                return topic
        return None

    def __repr__(self) -> str:
        levels = ", ".join(f"{level.suffix}:{level.delay:g}s" for level in self.by_retry)
        return f"RetryTopicPlan({levels})"
