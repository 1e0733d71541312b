"""kafkatx: transactional Kafka listener containers for Python."""

from kafkatx._version import __version__
from kafkatx.record import Output, Record

__all__ = ["Output", "Record", "__version__"]
