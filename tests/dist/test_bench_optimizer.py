"""``sparsecomm bench optimizer`` on 2 spawned gloo ranks, a tiny GPT and a few steps."""

from __future__ import annotations

import pytest

from bindings.stats import ring_bytes
from optim.apps.benchmarks.optimizer import (
    OptimizerBenchConfig,
    bench_variants,
    optimizer_bench_worker,
    summarize_ranks,
)
from optim.apps.cli.bench import format_optimizer_table
from optim.apps.train_job.model import GPT
from optim.optimizers.demo import demo_plan
from sparsecomm.quantized import Quantizer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

TINY = OptimizerBenchConfig(
    nproc=2, d_model=32, n_layers=1, n_heads=2, context=16, batch=1, steps=3, warmup=2, job_timeout_s=60.0
)
NAMES = [
    "adamw",
    "adams",
    "scape@0.1",
    "scape@0.1/inline",
    "scape@0.01",
    "scape@0.01/inline",
    "local@0.1",
    "local@0.1/overlap",
    "local@0.1/lean",
    "local@0.01",
    "local@0.01/overlap",
    "local@0.01/lean",
    "local-adamw@0.1",
    "local-adamw@0.01",
    "coded-adamw@0.1",
    "demo-sgd@0.1",
    "demo-sgd@0.01",
]
SHARDED = NAMES[:6]


def test_config_rejects_a_warmup_that_would_time_dense_scape_steps() -> None:
    with pytest.raises(ValueError, match="warmup"):
        OptimizerBenchConfig(warmup=1, scape_warmup_steps=1, mask_delay=1)
    with pytest.raises(ValueError, match="densities"):
        OptimizerBenchConfig(densities=(1.0,))


@pytest.mark.timeout(120)
def test_optimizer_bench_structure_and_sanity() -> None:
    per_rank = run_ranks(optimizer_bench_worker, 2, TINY, timeout=90.0)
    assert [pr["rank"] for pr in per_rank] == [0, 1]
    bench = summarize_ranks(TINY, per_rank)
    rows = {r["name"]: r for r in bench["rows"]}
    assert list(rows) == NAMES

    n = GPT(TINY.model_config()).num_parameters()
    shard = -(-n // 2)
    # SCAPE keeps its master shard in the parameters themselves: not memory of its own
    n_state = {"adamw": 3, "adams": 2, "scape@0.1": 1, "scape@0.01": 1, "scape@0.1/inline": 1, "scape@0.01/inline": 1}
    for name in SHARDED:
        r = rows[name]
        assert r["num_parameters"] == n and r["param_bytes"] == 4 * n and r["shard_size"] == shard
        # Every rank holds exactly its shard of the master weights (dense) and of each state tensor.
        assert r["state_bytes_per_rank"] == [n_state[name] * 4 * shard] * 2
        parts = (
            {"exp_avg"} | ({"exp_avg_sq"} if name == "adamw" else set()) | ({"master"} if "@" not in name else set())
        )
        assert r["state_bytes_by_part"] == {p: 4 * shard for p in parts}
        assert r["state_to_full_master"] == pytest.approx(n_state[name] * shard / n)
        assert r["step_ms"] > 0 and r["opt_step_ms"] > 0 and r["opt_step_ms"] <= r["step_ms"]
        # Timings are the max over ranks of the per-rank medians.
        assert max(r["step_ms_per_rank_median"]) == pytest.approx(r["step_ms"])
        assert r["wire_bytes_per_step"] > 0

    # Dense ZeRO-1: one reduce_scatter + one all_gather of the padded flat fp32 buffer per step.
    rs, _ = ring_bytes("reduce_scatter", 4 * shard, 2)
    ag, _ = ring_bytes("all_gather", 4 * shard, 2)
    for name in ("adamw", "adams"):
        by_op = rows[name]["wire_bytes_per_step_by_op"]
        assert by_op["reduce_scatter"] == rs and by_op["all_gather"] == ag

    # SCAPE: every timed step sparse, fewer wire bytes than dense, fewer at the lower density.
    for name in ("scape@0.1", "scape@0.01", "scape@0.1/inline", "scape@0.01/inline"):
        r = rows[name]
        assert r["sparse_steps"] == TINY.steps
        assert "reduce_scatter" not in r["wire_bytes_per_step_by_op"]
        assert {"sparse_reduce_scatter", "sparse_all_gather"} <= set(r["wire_bytes_per_step_by_op"])
        assert r["wire_bytes_per_step"] < rows["adams"]["wire_bytes_per_step"]
    assert rows["scape@0.01"]["wire_bytes_per_step"] < rows["scape@0.1"]["wire_bytes_per_step"]
    for d in ("0.1", "0.01"):  # where the mask piece is built moves no byte
        assert rows[f"scape@{d}/inline"]["wire_bytes_per_step_by_op"] == rows[f"scape@{d}"]["wire_bytes_per_step_by_op"]

    # LocalAdamS: full-size m, normalizer statistic and anchor, the owner's code residual of its shard, and at
    # 0.1 (average_moment) the first moment's anchor and its owner's residual; the master shard is its replica's
    # slice, the parameters' memory. Its codes move fewer bytes at 0.01.
    padded = 2 * shard
    for d in ("0.1", "0.01"):
        r = rows[f"local@{d}"]
        moment = {"exp_avg_anchor": 4 * padded, "exp_avg_wire_residual": 4 * shard} if d == "0.1" else {}
        assert r["state_bytes_by_part"] == {
            "exp_avg": 4 * padded,
            "exp_avg_sq": 4 * padded,
            "anchor": 4 * padded,
            "wire_residual": 4 * shard,
            **moment,
        }
        assert r["state_bytes_per_rank"] == [sum(r["state_bytes_by_part"].values())] * 2
        assert {"quantized_all_reduce"} <= set(r["wire_bytes_per_step_by_op"])
        assert 0 < r["wire_bytes_per_step"] < rows["adams"]["wire_bytes_per_step"]
        assert r["step_ms"] > 0 and r["opt_step_ms"] <= r["step_ms"]
    assert rows["local@0.01"]["wire_bytes_per_step"] < rows["local@0.1"]["wire_bytes_per_step"]
    for d in ("0.1", "0.01"):
        # overlap: the same state and the same bytes; lean: the normalizer's EMA in bfloat16, half its bytes
        plain, overlap, lean = (rows[f"local@{d}{v}"] for v in ("", "/overlap", "/lean"))
        assert overlap["state_bytes_by_part"] == plain["state_bytes_by_part"]
        assert overlap["wire_bytes_per_step_by_op"] == plain["wire_bytes_per_step_by_op"]
        assert lean["state_bytes_by_part"] == {**plain["state_bytes_by_part"], "exp_avg_sq": 2 * padded}

    # a wrapped AdamW: AdamW's own two moments per parameter, the anchor and the owner's code residual
    for d in ("0.1", "0.01"):
        r = rows[f"local-adamw@{d}"]
        assert r["state_bytes_by_part"] == {
            "exp_avg": 4 * n,
            "exp_avg_sq": 4 * n,
            "anchor": 4 * padded,
            "wire_residual": 4 * shard,
        }
        # the codes, the measured noise's 66 float32 values (noise="auto" for AdamW) and the 65 of the norm
        # a local step clips by (the bench clips)
        by_op = r["wire_bytes_per_step_by_op"]
        assert set(by_op) == {"quantized_all_reduce", "noise", "grad_clip"}
        assert by_op["noise"] == rows["local@0.01"]["wire_bytes_per_step_by_op"]["noise"]
        assert 0 < by_op["grad_clip"] < by_op["noise"]
    # AdamW on the average gradient in codes (0.01 is below what its codes fit: no row): AdamW's own moments, this
    # rank's residual of the whole model and the owner's of its shard; 2-bit codes out, 4-bit averages back
    coded = rows["coded-adamw@0.1"]
    assert coded["state_bytes_by_part"] == {
        "exp_avg": 4 * n,
        "exp_avg_sq": 4 * n,
        "residual": 4 * padded,
        "own_residual": 4 * shard,
    }
    q2, q4 = Quantizer(bits=2, block=64), Quantizer(bits=4, block=128)
    assert coded["wire_bytes_per_step_by_op"] == {"coded_gradients": q2.encoded_bytes(shard) + q4.encoded_bytes(shard)}
    # SGD inside DeMo: no state of SGD's own, this rank's momentum over whole chunks; one all_gather of each
    # rank's k values per chunk and their bit-packed positions (to the one other rank)
    for d in (0.1, 0.01):
        plan = demo_plan(d, 2)
        chunks = -(-n // plan.chunk)
        r = rows[f"demo-sgd@{d:g}"]
        assert r["state_bytes_by_part"] == {"momentum": 4 * chunks * plan.chunk}
        payload = chunks * plan.k * 4 + -(-chunks * plan.k * plan.width // 8)
        assert r["wire_bytes_per_step_by_op"] == {"demo": payload}
    # 0.01: LocalAdamS averages no first moments either (its measured normalizer adds the noise sketch)
    local_codes = rows["local@0.01"]["wire_bytes_per_step_by_op"]["quantized_all_reduce"]
    assert rows["local-adamw@0.01"]["wire_bytes_per_step_by_op"]["quantized_all_reduce"] == local_codes

    assert rows["adams"]["speedup"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["speedup"] == pytest.approx(rows["adams"]["step_ms"] / r["step_ms"])
    table = format_optimizer_table(bench).splitlines()
    assert len(table) == 4 + len(NAMES) and table[-1].split()[0] == "demo-sgd@0.01"
    plain = OptimizerBenchConfig(
        inline_rows=False, local_rows=False, local_adamw_rows=False, coded_rows=False, demo_rows=False
    )
    assert [n for n, _, _ in bench_variants(plain)] == ["adamw", "adams", "scape@0.1", "scape@0.01"]
    low = OptimizerBenchConfig(
        densities=(0.1, 1e-4), inline_rows=False, local_rows=False, local_adamw_rows=False, coded_rows=False
    )  # DeMo only where one component of its longest chunk fits the bytes
    assert [n for n, _, _ in bench_variants(low)] == ["adamw", "adams", "scape@0.1", "scape@0.0001", "demo-sgd@0.1"]
