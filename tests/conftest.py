"""Session-wide settings of the suite.

Every ``sparsecomm launch`` (and in-process :class:`~resilient_comm.launcher.Launcher`) the tests start
forks its workers and spares from a fork server that imported torch and the project once
(``SPARSECOMM_LAUNCH_PRELOAD``; see :class:`bindings.spawn.ForkedPython`): they are still separate OS
processes, killed and stopped for real, but each starts in milliseconds instead of importing torch.

``make test`` runs the files on two workers (``pytest -n 2 --dist loadfile``), the longest first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient_comm.launcher import ENV_PRELOAD
from tests.dist.harness import PRELOAD

os.environ.setdefault(ENV_PRELOAD, ",".join(PRELOAD))


def _file_seconds() -> dict[str, float]:
    """Seconds each test file took in the run recorded in ``tests/durations.txt`` (its first block)."""
    path = Path(__file__).with_name("durations.txt")
    seconds: dict[str, float] = {}
    seen: set[str] = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        fields = line.split()
        if len(fields) != 2 or line.startswith("#") or fields[1] in seen:
            continue  # a later block records an older run of the same test
        seen.add(fields[1])
        file = fields[1].split("::", 1)[0]
        seconds[file] = seconds.get(file, 0.0) + float(fields[0])
    return seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadfile`` the files are handed out in collection order: the longest first
    (by ``tests/durations.txt``), so that no long file starts last and runs on while the other workers idle.
    The tests of a file keep their order; a serial run keeps pytest's order."""
    if not getattr(config.option, "numprocesses", None):
        return
    seconds = _file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))
