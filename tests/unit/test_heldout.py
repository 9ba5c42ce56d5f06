"""The held-out split of the convergence suite: its data, its models, its settings and its record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from optim.apps.benchmarks import suite as suite_module
from optim.apps.benchmarks.suite import run_suite
from optim.apps.benchmarks.suite_report import format_suite_table, suite_table, summary_table
from optim.apps.benchmarks.suite_settings import (
    DEFAULT_SEEDS,
    FIRST_HELDOUT_SEED,
    HELDOUT_SEEDS,
    HELDOUT_SETTINGS,
    HORIZONS,
    SETTING_HORIZONS,
    SETTINGS,
    SPLITS,
    SUITE_BASE,
    TUNING_SETTINGS,
    split_of,
)
from optim.apps.cli.main import main
from optim.apps.cli.render import RenderError, render_text
from optim.apps.train_job.data import torch_doc_bytes
from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.small_models import DigitsCNN, RecurrentLM
from optim.apps.train_job.tasks import TaskSpec, make_task

ROOT = Path(__file__).resolve().parents[2]


def test_torch_doc_corpus_is_deterministic_capped_prose() -> None:
    text, count, version = torch_doc_bytes(300_000)
    assert len(text) == 300_000 and count > 10 and version == f"torch {torch.__version__}"
    assert torch_doc_bytes(300_000) == (text, count, version)
    assert text.startswith(b"## torch.") and b"\n## torch." in text
    assert torch_doc_bytes(1000)[0] == text[:1000]
    with pytest.raises(ValueError, match="max_bytes"):
        torch_doc_bytes(0)


def test_recurrent_lm_is_causal_and_seeded() -> None:
    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=256, d_model=16, n_layers=2)
    torch.manual_seed(0)
    twin = RecurrentLM(vocab_size=256, d_model=16, n_layers=2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    x = torch.randint(0, 256, (3, 12))
    logits, loss = model(x, x)
    assert logits.shape == (3, 12, 256) and loss is not None and loss.ndim == 0
    changed = x.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256
    assert torch.allclose(model(changed)[0][:, :7], logits[:, :7])  # no position sees a later token
    assert model(x)[1] is None
    for bad in ({"d_model": 0}, {"n_layers": 1.5}, {"vocab_size": True}):
        with pytest.raises(ValueError):
            RecurrentLM(**{"vocab_size": 256, "d_model": 8, "n_layers": 1, **bad})


def test_digits_cnn_shapes_and_seeding() -> None:
    torch.manual_seed(1)
    model = DigitsCNN(channels=8, layers=3)
    torch.manual_seed(1)
    twin = DigitsCNN(channels=8, layers=3)
    x = torch.rand(5, 64)
    logits, loss = model(x, torch.arange(5))
    assert logits.shape == (5, 10) and loss is not None
    assert torch.equal(logits, twin(x)[0])
    assert len(model.convs) == 3 and model.convs[0].in_channels == 1
    with pytest.raises(ValueError, match="channels"):
        DigitsCNN(channels=0, layers=1)


@pytest.mark.parametrize(
    "spec",
    [
        TaskSpec(corpus="torchdoc", batch=4, context=16, d_model=16, n_layers=1, n_heads=2, max_corpus_bytes=200_000),
        TaskSpec(corpus="pydoc", arch="gru", batch=4, context=16, d_model=16, n_layers=2, n_heads=2),
        TaskSpec(task="digits", arch="cnn", batch=5, d_model=8, n_layers=2),
    ],
    ids=["torchdoc-gpt", "pydoc-gru", "digits-cnn"],
)
def test_new_tasks_are_deterministic_and_train(spec: TaskSpec) -> None:
    task, again = make_task(spec), make_task(spec)
    x, y = task.train_batch(2, 1)
    assert torch.equal(x, again.train_batch(2, 1)[0]) and torch.equal(y, again.train_batch(2, 1)[1])
    assert not torch.equal(task.train_batch(2, 0)[0], x)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        _, loss = model(x, y)
        assert loss is not None
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0]
    assert task.describe()["arch"] == ("mlp" if spec.arch == "gpt" and spec.task == "digits" else spec.arch)


def test_torchdoc_corpus_is_named_and_digits_default_is_the_mlp() -> None:
    text = make_task(TaskSpec(corpus="torchdoc", max_corpus_bytes=100_000)).describe()["corpus"]
    assert text["name"] == f"torchdoc:torch {torch.__version__}" and text["num_bytes"] == 100_000
    assert make_task(TaskSpec(task="digits")).describe()["arch"] == "mlp"  # arch left at its default


@pytest.mark.parametrize("bad", [{"arch": "cnn"}, {"arch": "mlp"}, {"task": "digits", "arch": "gru"}])
def test_an_arch_of_the_other_task_is_refused(bad: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="arch"):
        TaskSpec(**bad)


@pytest.mark.parametrize("name", sorted(HELDOUT_SETTINGS))
def test_every_heldout_setting_is_a_valid_run(name: str) -> None:
    horizons = SETTING_HORIZONS.get(name, HORIZONS)
    for h in horizons:
        config = TrainConfig(**{**SUITE_BASE, **HELDOUT_SETTINGS[name]}, steps=h)
        assert h % config.eval_interval == 0 and config.nproc == 4
    assert split_of(name) == "heldout" and name not in TUNING_SETTINGS


def _shape(name: str) -> tuple[Any, ...]:
    c = TrainConfig(**{**SUITE_BASE, **SETTINGS[name]})
    return c.task, c.corpus if c.task == "text" else "-", c.arch, c.d_model, c.n_layers, SETTING_HORIZONS.get(name)


def test_heldout_settings_differ_from_every_tuning_setting() -> None:
    """In data, model family or size, or horizon: none is a tuning setting with other hyperparameters."""
    tuning = {_shape(n) for n in TUNING_SETTINGS}
    assert all(_shape(n) not in tuning for n in HELDOUT_SETTINGS)
    tuning_corpora = {SETTINGS[n].get("corpus") for n in TUNING_SETTINGS}
    assert any(SETTINGS[n].get("corpus") not in tuning_corpora | {None} for n in HELDOUT_SETTINGS)
    assert max(SETTING_HORIZONS["digits-mlp-cosine-3k"]) == 3000
    assert SPLITS["all"] == SPLITS["tuning"] + SPLITS["heldout"] and len(SPLITS["heldout"]) >= 4
    assert min(HELDOUT_SEEDS) >= FIRST_HELDOUT_SEED > 2 and DEFAULT_SEEDS["tuning"] == (0,)


def _fake_convergence(base: TrainConfig, densities: Any, **_: Any) -> dict[str, Any]:
    """A stand-in for run_convergence: losses that depend on the seed, the run and the step only."""
    runs = []
    for name, factor in (("adamw", 0.9), ("adams", 1.0), ("local@0.1", 1.05)):
        evals = [
            {"step": s, "val_loss": factor * (2.0 + base.seed % 7) / (1 + s / 1000)}
            for s in range(0, base.steps + 1, base.eval_interval)
        ]
        runs.append(
            {
                "name": name,
                "optimizer": {"name": "local-adams" if "@" in name else name},
                "density": 0.1 if "@" in name else 1.0,
                "evals": evals,
                "optimizer_wire_bytes_per_step": 10.0 if "@" in name else 100.0,
                "largest_loss_rise": 0.0,
            }
        )
    return {"runs": runs}


def test_suite_record_says_split_and_seeds_and_best_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite_module, "run_convergence", _fake_convergence)
    suite = run_suite(["digits-mlp-cosine-3k", "digits-mlp-const"], split="all", methods=("local",), densities=(0.1,))
    assert suite["split"] == "all"
    assert suite["split_seeds"] == {"heldout": list(HELDOUT_SEEDS), "tuning": [0]}
    assert suite["seeds"] == [0, *HELDOUT_SEEDS]
    assert suite["setting_horizons"] == {"digits-mlp-cosine-3k": [3000], "digits-mlp-const": list(HORIZONS)}
    assert suite["horizons"] == [300, 1000, 3000]
    cells = {(r["setting"], r["horizon"], r["name"]): r for r in suite["rows"]}
    local = cells[("digits-mlp-cosine-3k", 3000, "local@0.1")]
    assert local["seeds"] == list(HELDOUT_SEEDS) and local["best_dense"] == "adamw"
    assert local["ratio_to_best_dense"] == pytest.approx(1.05 / 0.9) == pytest.approx(local["ratio_to_adamw"])
    assert local["ratio_to_adams"] == pytest.approx(1.05)
    assert cells[("digits-mlp-const", 300, "adams")]["ratio_to_best_dense"] == pytest.approx(1 / 0.9)
    best = format_suite_table(suite, against="best")
    assert "best" in best.splitlines()[0] and "1.1667" in best
    held = run_suite(["digits-cnn-cosine"], split="heldout", methods=("local",), densities=(0.1,), horizons=(100,))
    assert held["split_seeds"] == {"heldout": list(HELDOUT_SEEDS)} and held["horizons"] == [100]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"settings": ["digits-cnn-cosine"]}, "held"),  # a held-out setting on the tuning split
        ({"settings": ["digits-mlp-const"], "split": "heldout"}, "tuning split"),
        ({"split": "test"}, "split"),
        ({"settings": ["imagenet"], "split": "all"}, "unknown setting"),
        ({"settings": [], "split": "all"}, "no settings"),
        ({"split": "heldout", "seeds": ()}, "seeds"),
    ],
)
def test_suite_refuses_a_setting_outside_its_split(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_suite(**kwargs)


def test_tables_of_old_result_files_show_the_best_dense_ratio() -> None:
    """A file recorded before ratio_to_best_dense: the ratio comes from the cell's dense losses."""
    stored = json.loads((ROOT / "benchmarks/results/suite/suite.json").read_text())
    assert all("ratio_to_best_dense" not in r for r in stored["rows"])
    table = suite_table(stored, against="best")
    assert table.columns[3] == "best" and "adams" in table.columns and "adamw" in table.columns
    cell = {r["name"]: r for r in stored["rows"] if (r["setting"], r["horizon"]) == (table.rows[0][0], 300)}
    best = min(cell["adams"]["val_loss"], cell["adamw"]["val_loss"])
    scape = table.columns.index("scape@0.1")
    assert table.rows[0][scape] == f"{cell['scape@0.1']['val_loss'] / best:.4f}"
    assert suite_table(stored) == suite_table(stored, against="reference")
    assert summary_table([("s", stored)], against="best").rows != summary_table([("s", stored)]).rows
    with pytest.raises(ValueError, match="against"):
        suite_table(stored, against="adamw")


def test_render_takes_against_best() -> None:
    marker = "<!-- table: benchmarks/results/suite/suite.json kind=suite against={} -->\n<!-- /table -->\n"
    assert "| best |" in render_text(marker.format("best"), ROOT)
    with pytest.raises(RenderError, match="against"):
        render_text(marker.format("worst"), ROOT)


def test_cli_runs_the_heldout_split_on_its_own_seeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite_module, "run_convergence", _fake_convergence)
    out = tmp_path / "held"
    argv = ["bench", "convergence", "--suite", "--split", "heldout", "--settings", "digits-cnn-cosine"]
    assert main([*argv, "--methods", "local", "--densities", "0.1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "heldout split" in printed and "heldout seeds 100,101,102" in printed and "the better of" in printed
    data = json.loads((out / "suite.json").read_text())
    assert data["split"] == "heldout" and data["seeds"] == list(HELDOUT_SEEDS)
    tuning = ["bench", "convergence", "--suite", "--settings", "digits-mlp-const", "--seed", "4"]
    assert main([*tuning, "--out", str(out)]) == 0
    assert json.loads((out / "suite.json").read_text())["split_seeds"] == {"tuning": [4]}
    with pytest.raises(SystemExit):
        main([*argv[:3], "--settings", "digits-cnn-cosine", "--out", str(out)])  # not in the tuning split
    assert "heldout split" in capsys.readouterr().err
