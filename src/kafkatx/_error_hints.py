"""Old path of :mod:`kafkatx.errors.hints`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.errors import hints as _moved
from kafkatx.errors.hints import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
