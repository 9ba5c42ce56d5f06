"""The training tasks (:mod:`optim.apps.train_job.tasks`) and the suite's settings (``optim.apps.benchmarks``)."""

from __future__ import annotations

import pytest
import torch

from optim.apps.benchmarks.suite import SETTINGS, SUITE_BASE, mean_over_seeds, run_suite, worst_case
from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.tasks import TaskSpec, make_task, synthetic_text


def test_synthetic_text_is_deterministic_and_structured() -> None:
    a, b = synthetic_text(50_000), synthetic_text(50_000)
    assert a == b and len(a) == 50_000
    assert synthetic_text(50_000, seed=8) != a
    lines = a.decode().splitlines()[:-1]
    assert all(line.endswith(" .") for line in lines)
    counting = [line.split()[:-1] for line in lines if line[0].isdigit()]
    assert counting and all([int(x) for x in c] == list(range(int(c[0]), int(c[0]) + len(c))) for c in counting)


@pytest.mark.parametrize(
    "spec",
    [
        TaskSpec(corpus="pydoc", batch=4, context=16, d_model=16, n_layers=1, n_heads=2),
        TaskSpec(corpus="synthetic", arch="encoder", batch=4, context=16, d_model=16, n_layers=1, n_heads=2),
        TaskSpec(task="digits", batch=5, d_model=16, n_layers=2),
    ],
    ids=["pydoc-gpt", "synthetic-encoder", "digits-mlp"],
)
def test_tasks_are_deterministic_and_train(spec: TaskSpec) -> None:
    task, again = make_task(spec), make_task(spec)
    x, y = task.train_batch(3, 1)
    x2, y2 = again.train_batch(3, 1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(task.train_batch(3, 0)[0], x)  # ranks draw different batches
    assert torch.equal(task.val_batch(0, 1)[0], again.val_batch(0, 1)[0])
    torch.manual_seed(0)
    model = task.build_model()
    torch.manual_seed(0)
    twin = again.build_model()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(20):
        _, loss = model(x, y)
        assert loss is not None
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first  # it learns its batch
    about = task.describe()
    assert about["task"] == spec.task and "corpus" in about and "model" in about


def test_digits_split_is_fixed() -> None:
    task = make_task(TaskSpec(task="digits"))
    about = task.describe()["corpus"]
    assert about["train"] + about["val"] == 1797 and about["val"] == 1797 // 5


def test_bad_task_fields_raise() -> None:
    for bad in ({"task": "images"}, {"corpus": "web"}, {"arch": "rnn"}, {"d_model": 30, "n_heads": 4}):
        with pytest.raises(ValueError):
            TrainConfig(**bad)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_suite_setting_is_a_valid_run(name: str) -> None:
    config = TrainConfig(**{**SUITE_BASE, **SETTINGS[name]}, steps=1000)
    assert 1000 % config.eval_interval == 0 and 300 % config.eval_interval == 0
    assert config.nproc == 4


def test_worst_case_takes_the_maximum_and_judges_targets() -> None:
    rows = [
        {"name": "adams", "density": 1.0, "setting": "a", "horizon": 300, "ratio_to_adams": 1.0},
        {"name": "local@0.1", "density": 0.1, "setting": "a", "horizon": 300, "ratio_to_adams": 1.01},
        {"name": "local@0.1", "density": 0.1, "setting": "b", "horizon": 300, "ratio_to_adams": 1.03},
        {"name": "local@0.1", "density": 0.1, "setting": "b", "horizon": 1000, "ratio_to_adams": 0.99},
        {"name": "scape@0.01", "density": 0.01, "setting": "a", "horizon": 300, "ratio_to_adams": 1.04},
    ]
    w = worst_case(rows)
    assert w["local@0.1"]["by_horizon"]["300"] == {"ratio": 1.03, "setting": "b"}
    assert w["local@0.1"]["met"] is False and w["local@0.1"]["max_ratio"] == 1.02
    assert w["scape@0.01"]["met"] is True
    assert w["adams"]["met"] is None


def _seed_row(name: str, seed: int, val: float, ref: float) -> dict[str, object]:
    return {
        "setting": "s", "horizon": 300, "trained_steps": 300, "name": name, "optimizer": name,
        "density": 0.1 if "@" in name else 1.0, "seed": seed, "val_loss": val, "ratio_to_adams": val / ref,
        "optimizer_wire_bytes_per_step": 10.0 * (seed + 1), "wire_ratio_to_adams": 0.1 if "@" in name else 1.0,
        "largest_loss_rise": 0.1 * (seed + 1), "dense_largest_loss_rise": 0.3, "evals": [{"step": 300}],
    }  # fmt: skip


def test_mean_over_seeds_takes_the_ratio_of_means_and_keeps_each_seed() -> None:
    dense = {0: 2.0, 1: 4.0}
    rows = [_seed_row(n, s, v, dense[s]) for s in (1, 0) for n, v in (("adams", dense[s]), ("adamw", 3.0))]
    rows += [_seed_row("local@0.1", 0, 1.0, 2.0), _seed_row("local@0.1", 1, 5.0, 4.0)]
    by = {r["name"]: r for r in mean_over_seeds(rows)}
    local = by["local@0.1"]
    assert local["val_loss"] == 3.0 and local["ratio_to_adams"] == 1.0  # (1 + 5) / 2 over (2 + 4) / 2
    assert local["ratio_to_adamw"] == 1.0 and local["seed_ratios"] == [0.5, 1.25] and local["seeds"] == [0, 1]
    assert local["dense_seed_spread"] == 2.0 and local["largest_loss_rise"] == 0.2
    assert local["optimizer_wire_bytes_per_step"] == 15.0 and set(local["evals"]) == {"0", "1"}
    assert by["adams"]["ratio_to_adams"] == 1.0
    w = worst_case(list(by.values()))
    assert w["local@0.1"]["by_horizon"]["300"]["seed_ratios"] == [0.5, 1.25]
    with pytest.raises(ValueError, match="seeds"):
        mean_over_seeds(rows[:-1] + [rows[0] | {"name": "local@0.1", "seed": 7}])


@pytest.mark.parametrize("seeds", [(), (0, 0), (-1,)])
def test_suite_refuses_bad_seeds_before_running(seeds: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="seeds"):
        run_suite(["digits-mlp-const"], seeds=seeds)
    with pytest.raises(ValueError, match="seeds"):
        run_suite(["digits-mlp-const"], overrides={"seed": 3})
