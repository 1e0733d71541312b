"""Old path of :mod:`kafkatx.cli.run`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.cli import run as _moved
from kafkatx.cli.run import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
