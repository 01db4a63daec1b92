"""User models that break the model protocol (harness/train/user_models.py), one way each: the
bad-input table (bad_inputs.py) names them on the command line, `suites/harness/end_to_end/test_user_model.py` checks
them directly. Each is the example model (suites/harness/unit/example_model.py) with one member changed."""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import nn

from suites.harness.unit.example_model import spec as example


def _changed(**members):
    return dataclasses.replace(example, **members)


sum_loss = _changed(loss=lambda out, y: F.cross_entropy(out, y, reduction="sum"))
build_returns_none = _changed(build=lambda: None)
units_not_submodules = _changed(units=lambda model: [nn.Linear(2, 2)])
batch_one_short = _changed(make_batch=lambda n, step, seed: example.make_batch(n - 1, step, seed))
forward_raises = _changed(
    make_batch=lambda n, step, seed: (example.make_batch(n, step, seed)[0][:, :1], example.make_batch(n, step, seed)[1])
)
