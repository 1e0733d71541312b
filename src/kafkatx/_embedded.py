"""Old path of :mod:`kafkatx.client.brokers`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.client import brokers as _moved
from kafkatx.client.brokers import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
