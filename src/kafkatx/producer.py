"""Old path of :mod:`kafkatx.client.producer` (documented; keep it)."""

import sys

from kafkatx.client import producer as _moved
from kafkatx.client.producer import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
