"""Old path of :mod:`kafkatx.client.topics`, kept until listener/ and rollback/ import the new one."""

import sys

from kafkatx.client import topics as _moved
from kafkatx.client.topics import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
