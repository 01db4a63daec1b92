"""Per-unit state: the hooks that drive each FlatParamHandle through a training step."""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from .handle import FlatParamHandle


class TrainingState(Enum):
    IDLE = auto()  # between steps, or forward done with no backward pending
    FORWARD = auto()  # inside the unit's forward
    PRE_BACKWARD = auto()  # backward has reached the unit's outputs; parameters gathered again
    BACKWARD_DONE = auto()  # the final callback of this backward has run


class UnitState:
    """Attached to each module passed to fully_shard as ``module._fsdp_state``."""

    def __init__(self, module: nn.Module, handles: list[FlatParamHandle], reshard_after_forward: bool,
                 param_dtype: torch.dtype | None):
        self.module = module
        self.handles = handles
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.training_state = TrainingState.IDLE
        self._callback_queued = False
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    def _pre_forward(self, module, args, kwargs):
        self.training_state = TrainingState.FORWARD
        for h in self.handles:
            h.unshard()
        if self.param_dtype is not None:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        return args, kwargs

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
            return x.to(self.param_dtype)
        return x

    def _post_forward(self, module, args, output):
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            for h in self.handles:
                h.reshard()
        self.training_state = TrainingState.IDLE
        return output

    def _pre_backward(self, grad):
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self.training_state = TrainingState.PRE_BACKWARD
            for h in self.handles:
                h.unshard_for_backward()
            if not self._callback_queued:
                self._callback_queued = True
                Variable._execution_engine.queue_callback(self._final_callback)
        return grad

    def _final_callback(self) -> None:
        # handles whose parameters got no gradient in this backward still hold full parameters
        for h in self.handles:
            h.reshard()
        self._callback_queued = False
        self.training_state = TrainingState.BACKWARD_DONE
