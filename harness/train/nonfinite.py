"""Where a run's first non-finite loss came from: the module whose forward output was first NaN or Inf.

Rank 0 looks once the run has trained and been measured, and only where a step's loss is not finite (the
common path pays one `math.isfinite` per step): the plain model is built, given the parameters the run had
before that step (its own snapshot, ``step<k-1>.pt``, what the parameter checks compare) and run forward on the
step's batch, cut as the run cut it, with a forward hook on every module. Hooks fire as each module's forward
returns, children before their parent, so the first hook that sees a non-finite output names the innermost
module that produced it. The `finite` check (harness/checks/numeric.py) names it.

`first_nonfinite_module` returns, for the record's ``nonfinite_module`` field:

- a module path of the plain model (``blocks.1.attn``), ``ROOT`` for the model's own forward;
- ``LOSS``: every module's output was finite, ``loss(outputs, targets)`` was not;
- ``NOT_REPRODUCED``: the plain model at the run's parameters gives a finite loss on that batch, so the
  non-finite value came from the implementation's step itself;
- ``""`` where it cannot be said (no snapshot before that step, or one that does not name the plain model's
  parameters: `params_cover_model` says which).
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.core.features import has
from harness.core.scenario import Scenario

# torch and the training code load only where a loss was not finite: the checks read these names
FIELD = "nonfinite_module"
ROOT, LOSS, NOT_REPRODUCED = "(model)", "(loss)", "(not reproduced by the plain model)"


def add_first_nonfinite(sc: Scenario, spec, snap_dir: Path, steps: list[dict], device) -> None:
    """Set FIELD in the record of the first step whose loss is not finite (nothing where every loss is)."""
    bad = next((rec for rec in steps if not math.isfinite(rec["loss"])), None)
    if bad is not None:
        bad[FIELD] = first_nonfinite_module(sc, spec, snap_dir, bad["step"], device)


def first_nonfinite_module(sc: Scenario, spec, snap_dir: Path, step: int, device) -> str:
    """The module (module docstring) whose output was first non-finite in the plain model's forward on step
    `step`'s batch at the parameters the run's snapshot of step `step` - 1 holds."""
    import torch

    from harness.adapters.reference import MixedPrecision
    from harness.train.data import global_batch
    from harness.train.features import BF16_POLICY
    from harness.train.params_file import load_params
    from harness.train.plain_eval import held_out_cut

    path = snap_dir / f"step{step - 1}.pt"
    if not path.exists():
        return ""
    torch.manual_seed(sc.seed)
    model = spec.build().to(device)
    params = dict(model.named_parameters())
    full = load_params(path)
    if set(full) != set(params):
        return ""
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(full[name])
    forward = MixedPrecision(model, BF16_POLICY["param_dtype"]) if has(sc.feature, "bf16") else model
    first: list[str] = []

    def hook(name: str):
        def seen(_module, _inputs, output) -> None:
            if not first and not _finite(output):
                first.append(name or ROOT)

        return seen

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            for x, y in held_out_cut(sc, *global_batch(spec, sc.global_batch, step, sc.seed)):
                out = forward(x.to(device))
                if first:
                    return first[0]
                loss = spec.loss(out.float() if has(sc.feature, "bf16") else out, y.to(device))
                if not _finite(loss):
                    return LOSS
    finally:
        for h in handles:
            h.remove()
    return NOT_REPRODUCED


def _finite(value) -> bool:
    """Every floating-point tensor in `value` (a tensor, or tuples, lists and dicts of them) finite."""
    import torch

    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True
