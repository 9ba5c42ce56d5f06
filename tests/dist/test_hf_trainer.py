"""Hugging Face Trainer under torchrun with the sharded optimizers (they must train, not sit still).

``Trainer`` replaces the storage of every parameter when it is built; an
optimizer that keeps views of the parameters must notice. The worker trains a
tiny GPT-2 from a config with dense AdamS as the reference and with
ShardedAdamS, ShardedAdamW and SCAPE in the same script.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.torchrun import run_torchrun_results

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist


def test_trainer_trains_with_sharded_optimizers(tmp_path: Path) -> None:
    names = ["adams", "adamw", "sharded_adams", "sharded_adamw", "scape1.0", "scape0.01"]
    ranks = run_torchrun_results("hf_trainer", tmp_path, "--optimizers", ",".join(names), timeout=300)
    for res in ranks:
        for name in names:
            r = res[name]
            assert r["changed"] == r["params"], (name, r)  # every parameter trained
            assert r["losses"][-1] < r["losses"][0] - 0.5, (name, r["losses"])  # and the loss falls
            assert r["digest"] == ranks[0][name]["digest"], name  # replicas agree
        # averaged gradients, the same update: the sharded AdamS runs are bitwise dense AdamS
        assert res["sharded_adams"]["digest"] == res["adams"]["digest"]
        assert res["scape1.0"]["digest"] == res["adams"]["digest"]
        for a, b in zip(res["sharded_adamw"]["losses"], res["adamw"]["losses"], strict=True):
            assert abs(a - b) < 0.01, (res["sharded_adamw"]["losses"], res["adamw"]["losses"])


def test_trainer_with_sparsecomm_comm_hooks(tmp_path: Path) -> None:
    """DDPCommCallback: SCAPE syncs while DDP sends nothing; AdamW rides on the sparse DDP hook."""
    names = ["scape0.01+noclip", "scape0.01+sync", "adamw", "adamw+hook0.1"]
    ranks = run_torchrun_results("hf_trainer", tmp_path, "--optimizers", ",".join(names), timeout=300)
    for res in ranks:
        for name in names:
            r = res[name]
            assert r["changed"] == r["params"], (name, r)
            assert r["losses"][-1] < r["losses"][0] - 0.5, (name, r["losses"])
            assert r["digest"] == ranks[0][name]["digest"], name
        assert res["scape0.01+sync"]["comm_hook"] == "noop_hook"
        assert res["adamw+hook0.1"]["comm_hook"] == "sparse_allreduce_hook"
        # SCAPE on each rank's own gradients computes what it computed on DDP's averaged ones
        assert res["scape0.01+sync"]["digest"] == res["scape0.01+noclip"]["digest"]
        assert res["scape0.01+sync"]["optimizer_bytes"] == res["scape0.01+noclip"]["optimizer_bytes"] > 0
        assert res["adamw+hook0.1"]["hook_bytes"] > 0 and res["adamw"]["hook_bytes"] == 0
