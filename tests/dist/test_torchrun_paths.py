"""torchrun, as users launch: the drop-in API, SCAPE, the sparse DDP hook and FSDP2 in one job of 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.torchrun import run_torchrun_results

pytestmark = pytest.mark.dist


def test_drop_in_scape_and_hook_under_torchrun(tmp_path: Path) -> None:
    ranks = run_torchrun_results("torchrun_paths", tmp_path, timeout=180)
    for res in ranks:
        assert res["world_size"] == 2 and res["all_reduce"] == [3.0] * 4
        for path in ("scape", "ddp-sparse-hook", "fsdp2"):
            r = res[path]
            assert r["digest"] == ranks[0][path]["digest"], path  # replicas agree
            assert sum(r["losses"][-5:]) < 0.5 * sum(r["losses"][:5]), (path, r["losses"])
        assert res["ddp-sparse-hook"]["hook_bytes"] > 0
        assert res["fsdp2"]["fsdp_bytes"] > 0  # FSDP2's gathers and reductions went through sparsecomm
