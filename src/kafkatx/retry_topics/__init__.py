"""Retry topics (``retry="topics"``, issue 40): a failed record waits in a topic, not in its partition.

The pure parts come first: which topic holds the n-th retry and when it is due
(:mod:`.plan`), and the headers a hop carries, in Spring's names and encodings so
that a mixed Java/Python fleet can share the topics (:mod:`.headers`).
"""

from kafkatx.retry_topics.headers import RetryHop, hop_headers, parse_hop
from kafkatx.retry_topics.plan import RetryLevel, RetryTopicPlan

__all__ = ["RetryHop", "RetryLevel", "RetryTopicPlan", "hop_headers", "parse_hop"]
