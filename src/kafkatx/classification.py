"""Old path of :mod:`kafkatx.errors.classification` (public: ``from kafkatx.classification import classify``; keep it)."""

import sys

from kafkatx.errors import classification as _moved
from kafkatx.errors.classification import *  # noqa: F403

sys.modules[__name__] = _moved  # the same module object: patching either name patches both
