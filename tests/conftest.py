"""Session-wide settings of the suite.

Every ``sparsecomm launch`` (and in-process :class:`~resilient_comm.launcher.Launcher`) the tests start
forks its workers and spares from a fork server that imported torch and the project once
(``SPARSECOMM_LAUNCH_PRELOAD``; see :class:`bindings.spawn.ForkedPython`): they are still separate OS
processes, killed and stopped for real, but each starts in milliseconds instead of importing torch.
"""

from __future__ import annotations

import os

from resilient_comm.launcher import ENV_PRELOAD
from tests.dist.harness import PRELOAD

os.environ.setdefault(ENV_PRELOAD, ",".join(PRELOAD))
