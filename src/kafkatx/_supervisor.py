"""Old path of :mod:`kafkatx.cli.supervisor`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.cli import supervisor as _moved
from kafkatx.cli.supervisor import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
