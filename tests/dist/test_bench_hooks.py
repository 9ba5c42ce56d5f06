"""``sparsecomm bench hooks``: every hook trains the same model, and the bytes are the analytic ones."""

from __future__ import annotations

import pytest

from bindings.stats import ring_bytes
from optim.apps.benchmarks.ddp_hooks import HookBenchConfig, hook_variants, run_hook_bench
from sparsecomm.mask import k_for, shard_size_for
from sparsecomm.schedule import wire_encoding

pytestmark = pytest.mark.dist


def test_hook_bench_rows_and_bytes() -> None:
    config = HookBenchConfig(
        nproc=2,
        d_model=32,
        n_layers=1,
        n_heads=2,
        batch=2,
        steps=12,
        start_iter=4,
        eval_batches=2,
        max_corpus_bytes=200_000,
        job_timeout_s=300,
    )
    bench = run_hook_bench(config)
    rows = {r["name"]: r for r in bench["rows"]}
    assert list(rows) == hook_variants(config)
    n = rows["ddp"]["num_parameters"]
    dense = ring_bytes("all_reduce", 4 * n, 2)[0]
    # one DDP bucket (the model is far below the 25 MB cap): plain DDP sends the ring bytes of all gradients
    assert rows["ddp"]["wire_bytes_per_step"] == dense == rows["ddp"]["dense_bytes_per_step"]
    for d in config.densities:
        k = k_for(n, 2, d)
        values = ring_bytes("all_reduce", 2 * k * 4, 2)[0]
        mask = wire_encoding(k, shard_size_for(n, 2))[1]  # one piece sent to the other rank per step
        assert rows[f"sparse@{d:g}"]["wire_bytes_per_step"] == values + mask
    for r in config.powersgd_ranks:
        assert 0 < rows[f"powersgd-r{r}"]["wire_bytes_per_step"] < dense
    assert rows["powersgd-r1"]["wire_bytes_per_step"] < rows["powersgd-r4"]["wire_bytes_per_step"]
    for r in rows.values():
        assert r["val_loss"] == r["val_loss"] and r["step_s_median"] > 0
        assert r["val_ratio_to_ddp"] == pytest.approx(r["val_loss"] / rows["ddp"]["val_loss"])


def test_hook_bench_config_is_checked() -> None:
    with pytest.raises(ValueError, match="densities"):
        HookBenchConfig(densities=(1.5,))
    with pytest.raises(ValueError, match="powersgd_ranks"):
        HookBenchConfig(powersgd_ranks=(0,))
    with pytest.raises(ValueError, match="start_iter"):
        HookBenchConfig(start_iter=-1)
