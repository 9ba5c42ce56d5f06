"""PyTorch Lightning under torchrun with sparsecomm's strategy (optim.integrations.lightning)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.torchrun import run_torchrun_results

pytest.importorskip("lightning")
pytestmark = pytest.mark.dist


def test_lightning_strategy_syncs_by_optimizer_or_sparse_hook(tmp_path: Path) -> None:
    ranks = run_torchrun_results("lightning_trainer", tmp_path, timeout=300)
    for res in ranks:
        for name, r in res.items():
            assert len(r["losses"]) == 40, name
            assert sum(r["losses"][-5:]) < 0.5 * sum(r["losses"][:5]), (name, r["losses"])
            assert r["digest"] == ranks[0][name]["digest"], name  # replicas agree
        assert res["scape"]["comm_hook"] == "noop_hook"
        assert res["scape"]["optimizer_bytes"] > 0 and res["scape"]["hook_bytes"] == 0
        assert res["adamw-hook"]["comm_hook"] == "sparse_allreduce_hook"
        assert res["adamw-hook"]["hook_bytes"] > 0
        assert res["adamw"]["comm_hook"] in ("", None)


def test_strategy_arguments_are_checked() -> None:
    from optim.integrations.lightning import SparseDDPStrategy

    with pytest.raises(TypeError, match="SparseHookState"):
        SparseDDPStrategy("0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        SparseDDPStrategy(ddp_comm_hook=print)
