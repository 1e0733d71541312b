"""Old path of :mod:`kafkatx.metrics.lag`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.metrics import lag as _moved
from kafkatx.metrics.lag import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
