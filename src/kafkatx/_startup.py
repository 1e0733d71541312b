"""Old path of :mod:`kafkatx.app.startup`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.app import startup as _moved
from kafkatx.app.startup import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
