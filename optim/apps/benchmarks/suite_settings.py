"""The convergence suite's settings, in two splits: the tuning split and the held-out split.

Every default of the library's sparse optimizers was chosen on the six
settings of :data:`TUNING_SETTINGS` (seeds 0 to 2). A default tuned on the
cells it is reported on flatters itself, so the settings of
:data:`HELDOUT_SETTINGS` differ from every tuning setting in data, model
family, model size or schedule, and run on seeds of their own
(:data:`HELDOUT_SEEDS`, from :data:`FIRST_HELDOUT_SEED` up). The rule:
defaults are chosen on the tuning split only; the held-out split runs once
per default change and is reported separately.

The held-out settings:

* ``stdlib-gpt-large-const``: a GPT wider and deeper than any tuning GPT
  (d 96, 3 layers: three times the parameters), constant learning rate;
* ``torchdoc-gpt-cosine``: the tuning GPT on a corpus no tuning setting reads
  (the docstrings of torch, :func:`optim.apps.train_job.data.torch_doc_bytes`);
* ``torchdoc-gru-const``: a recurrent byte LM (one GRU layer, d 128) on that corpus;
* ``digits-cnn-cosine``: a small CNN (two 3x3 convolutions of 32 channels) on scikit-learn's digits;
* ``digits-mlp-cosine-3k``: the smallest model (the digits MLP) on a cosine
  schedule of 3,000 steps, judged at its end only (:data:`SETTING_HORIZONS`).
"""

from __future__ import annotations

from bindings.json_object import JsonObject

__all__ = [
    "DEFAULT_SEEDS",
    "FIRST_HELDOUT_SEED",
    "HELDOUT_SEEDS",
    "HELDOUT_SETTINGS",
    "HORIZONS",
    "SETTINGS",
    "SETTING_HORIZONS",
    "SPLITS",
    "SUITE_BASE",
    "TUNING_SETTINGS",
    "split_of",
]

HORIZONS = (300, 1000)
"""Steps at which every setting is judged unless :data:`SETTING_HORIZONS` says otherwise."""

SUITE_BASE: JsonObject = {
    "nproc": 4,
    "batch": 8,
    "context": 64,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "eval_interval": 100,
    "eval_batches": 8,
    "max_corpus_bytes": 2_000_000,
    "betas": (0.9, 0.95),
}
"""What every setting shares unless it says otherwise: 4 ranks, small models, batch 8 per rank."""

_CONSTANT = {"warmup_steps": 0, "min_lr_ratio": 1.0}
_COSINE = {"warmup_steps": 30, "min_lr_ratio": 0.1}
_DIGITS_COSINE = {
    "task": "digits",
    "d_model": 128,
    "n_layers": 2,
    "batch": 16,
    "lr": 3e-3,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    **_COSINE,
}

TUNING_SETTINGS: dict[str, JsonObject] = {
    "stdlib-encoder-const": {
        "task": "text",
        "corpus": "stdlib",
        "arch": "encoder",
        "d_model": 96,
        "lr": 2e-3,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        **_CONSTANT,
    },
    "pydoc-gpt-cosine": {
        "task": "text",
        "corpus": "pydoc",
        "arch": "gpt",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        **_COSINE,
    },
    "synthetic-gpt-const-clip": {
        "task": "text",
        "corpus": "synthetic",
        "arch": "gpt",
        "lr": 2e-3,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        **_CONSTANT,
    },
    "stdlib-gpt-cosine": {
        "task": "text",
        "corpus": "stdlib",
        "arch": "gpt",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        **_COSINE,
    },
    "digits-mlp-const": {
        "task": "digits",
        "d_model": 128,
        "n_layers": 2,
        "batch": 16,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        **_CONSTANT,
    },
    "digits-mlp-cosine": dict(_DIGITS_COSINE),
}
"""The tuning split: name -> :class:`~optim.apps.train_job.job_config.TrainConfig` fields over :data:`SUITE_BASE`."""

HELDOUT_SETTINGS: dict[str, JsonObject] = {
    "stdlib-gpt-large-const": {
        "task": "text",
        "corpus": "stdlib",
        "arch": "gpt",
        "d_model": 96,
        "n_layers": 3,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        **_CONSTANT,
    },
    "torchdoc-gpt-cosine": {
        "task": "text",
        "corpus": "torchdoc",
        "arch": "gpt",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        **_COSINE,
    },
    "torchdoc-gru-const": {
        "task": "text",
        "corpus": "torchdoc",
        "arch": "gru",
        "d_model": 128,
        "n_layers": 1,
        "lr": 2e-3,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        **_CONSTANT,
    },
    "digits-cnn-cosine": {**_DIGITS_COSINE, "arch": "cnn", "d_model": 32},
    "digits-mlp-cosine-3k": dict(_DIGITS_COSINE),
}
"""The held-out split (see the module docstring), in the same form as :data:`TUNING_SETTINGS`."""

SETTINGS: dict[str, JsonObject] = {**TUNING_SETTINGS, **HELDOUT_SETTINGS}
"""Every setting of either split, by name (the names are unique across the splits)."""

SPLITS: dict[str, tuple[str, ...]] = {
    "tuning": tuple(TUNING_SETTINGS),
    "heldout": tuple(HELDOUT_SETTINGS),
    "all": tuple(SETTINGS),
}
"""The settings a suite of each split runs by default (and the only ones it admits)."""

SETTING_HORIZONS: dict[str, tuple[int, ...]] = {"digits-mlp-cosine-3k": (3000,)}
"""The settings judged at other steps than :data:`HORIZONS`."""

FIRST_HELDOUT_SEED = 100
"""Seeds from here up were never used for tuning (the tuning runs used 0 to 2)."""

HELDOUT_SEEDS = (FIRST_HELDOUT_SEED, FIRST_HELDOUT_SEED + 1, FIRST_HELDOUT_SEED + 2)
"""The held-out split's default seeds."""

DEFAULT_SEEDS: dict[str, tuple[int, ...]] = {"tuning": (0,), "heldout": HELDOUT_SEEDS}
"""Per split, the seeds its settings run on when none are given."""


def split_of(setting: str) -> str:
    """The split (``"tuning"`` or ``"heldout"``) a setting belongs to.

    Raises:
        ValueError: An unknown setting.
    """
    if setting in TUNING_SETTINGS:
        return "tuning"
    if setting in HELDOUT_SETTINGS:
        return "heldout"
    raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
