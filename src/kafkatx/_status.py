"""Old path of :mod:`kafkatx.cli.status`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.cli import status as _moved
from kafkatx.cli.status import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
