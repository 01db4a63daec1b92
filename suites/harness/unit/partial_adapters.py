"""fsdp_impl behind a `full_params` that misreports the parameters: one left out, one renamed, one
reshaped, or none at all. Training is correct in all of them; only what the harness is shown is
wrong, so only the parameter-coverage check can tell (tests in test_coverage.py)."""

from __future__ import annotations

from torch import Tensor, nn

from harness.adapters.fsdp_impl import FsdpImplAdapter

DROPPED = "layers.2.bias"  # a parameter of the zoo's mlp


class _Misreporting(FsdpImplAdapter):
    def edit(self, full: dict[str, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        return self.edit(super().full_params(wrapped))


class LeavesOneOut(_Misreporting):
    def edit(self, full):
        return {k: v for k, v in full.items() if k != DROPPED}


class Renames(_Misreporting):
    def edit(self, full):
        return {("renamed_bias" if k == DROPPED else k): v for k, v in full.items()}


class Reshapes(_Misreporting):
    def edit(self, full):
        return {k: (v.reshape(1, -1) if k == DROPPED else v) for k, v in full.items()}


class Empty(_Misreporting):
    def edit(self, full):
        return {}


leaves_one_out, renames, reshapes, empty = LeavesOneOut(), Renames(), Reshapes(), Empty()
