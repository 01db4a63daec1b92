"""What is checked once, before any world starts, on options that each parsed well on their own.

`check(matrix)` (through `checked_matrix(ns)`, as the CLI and the pytest plugin build their matrix):

- the user's models, held to the model protocol on the CPU of this process
  (harness/train/user_models.py check_model: build, units, a batch of the run's size, a forward that
  draws no random numbers (dropout: the module is named), a loss that is a mean over the batch, of the
  samples or weighted by a count each sample carries, such as a token mean, which the run then measures);
- the user's optimizers, each built by its factory over a probe parameter and stepped once
  (harness/optimizers.py check_optimizer: importable, callable, returns a torch.optim.Optimizer);
- the temp dir the run writes into (harness/core/scratch.py): a TMPDIR that cannot take a file;
- the upper limits of harness/limits.py (world size by memory, steps by the temp dir's free space),
  unless `--allow-large`.

Each problem is one `argparse.ArgumentTypeError` line: a usage error, never a failure of each scenario.

`checked_scenario(sc)` holds one scenario named by its id (`python -m harness localize ID`) to the same checks:
its implementation, model and optimizer parsed as `--impl`, `--models` and `--optimizers` parse them, its cell
validated as a matrix of one (`MatrixOptions.validate`) and then `check`ed, so that every verb answers bad input
as `run` does, with the same limits.
"""

from __future__ import annotations

import argparse
import os

from harness.core import names
from harness.options import MatrixOptions, matrix_from


def user_models(models) -> list[str]:
    """The user's own models among `models` (the zoo's and the Hugging Face ones are the harness's,
    held to the same protocol by its unit tests)."""
    return [
        m
        for m in models
        if m not in names.MODELS and m not in names.STANDARD_MODELS and not m.startswith(names.HF_PREFIX)
    ]


def checked_matrix(ns) -> MatrixOptions:
    """The matrix of parsed options (harness.options.matrix_from), checked here before any world starts."""
    matrix = matrix_from(ns)
    check(matrix)
    return matrix


def checked_scenario(sc, *, allow_large: bool = False) -> MatrixOptions:
    """The matrix of one scenario named by its id, each name parsed and the whole checked as `run` checks its
    options (module docstring); a usage error (one line) naming what is wrong."""
    from harness import options as opt
    from harness.core.scenario import REFERENCE_IMPL

    if sc.impl == REFERENCE_IMPL:
        raise argparse.ArgumentTypeError(
            f"{sc.id} is the plain reference itself: there is nothing to localise it against"
        )
    for what, parse, value in (
        ("implementation", opt.impls, sc.impl),
        ("model", opt.models, sc.model),
        ("optimizer", opt.optimizers, sc.optimizer),
    ):
        try:
            parse(value)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"scenario {sc.id}: {what}: {e}") from None
    matrix = MatrixOptions(
        impls=(sc.impl,),
        models=(sc.model,),
        world_sizes=tuple(sorted({sc.world_size, *([sc.resume_from] if sc.resume_from else [])})),
        data_modes=(sc.data_mode,),
        optimizers=(sc.optimizer,),
        steps=sc.steps,
        seeds=(sc.seed,),
        lr=sc.lr,
        global_batch=sc.global_batch,
        backend=sc.backend,
        features=(sc.feature,),
        allow_large=allow_large,
    )
    try:
        matrix.validate()
        check(matrix)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"scenario {sc.id}: {e}") from None
    return matrix


def check(matrix: MatrixOptions) -> None:
    _check_user_models(matrix)
    _check_user_optimizers(matrix)
    from harness.core.scratch import ScratchError, temp_dir

    try:
        temp = temp_dir()
    except ScratchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if matrix.allow_large:
        return
    from harness import limits

    sizes = {m: limits.model_size(m) for m in matrix.models}
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # under torchrun the job's size bounds the ranks
        limits.check_world_sizes(matrix.world_sizes, sizes)
    limits.check_steps(matrix.scenarios(), sizes, matrix.steps, temp)


def _check_user_models(matrix: MatrixOptions) -> None:
    mine = user_models(matrix.models)
    if not mine:
        return
    from harness.train.models import get_model_spec
    from harness.train.user_models import ModelError, check_model

    try:
        for name in mine:
            check_model(get_model_spec(name), matrix.global_batch, matrix.seeds[0], matrix.steps)
    except ModelError as e:
        raise argparse.ArgumentTypeError(f"--models: {e}") from None


def _check_user_optimizers(matrix: MatrixOptions) -> None:
    from harness.core.scenario import user_optimizer

    mine = [o for o in matrix.optimizers if user_optimizer(o)]
    if not mine:
        return
    from harness.optimizers import OptimizerError, check_optimizer

    try:
        for name in mine:
            check_optimizer(name, matrix.lr)
    except OptimizerError as e:
        raise argparse.ArgumentTypeError(f"--optimizers: {e}") from None
