"""Per-unit state: the hooks that drive a unit's ParamGroup through a training step.

    pre-forward    unshard (all-gather); cast floating inputs to param_dtype; wrap the inputs that
                   require grad in PostBackward, whose backward runs once autograd has computed the
                   gradients of the unit's inputs, i.e. after the unit's own backward
    post-forward   reshard (reshard_after_forward: fully, or keeping the post-forward group's block;
                   always fully under no_grad); hook the outputs
    pre-backward   (the first output gradient of this backward) unshard again; queue the final callback
    post-backward  (PostBackward, once per forward call with grad-requiring inputs; the last one)
                   reduce the gradients, reshard
    final callback (end of the whole backward) reduce and reshard whatever is left: units whose
                   inputs need no gradient (token ids), parameters whose gradient came late

[Note: when a unit's gradient is complete] Autograd runs every AccumulateGrad node as soon as it is
ready, before any other ready node, so by the time the gradient w.r.t. a unit's inputs has been
computed (PostBackward's backward), every parameter gradient of that call has been accumulated.
A unit called k times in one forward gets k PostBackward nodes and reduces at the last of them.
A call whose inputs need no gradient cannot be tracked that way: then the unit waits for the final
callback. The reduction runs once per backward either way: it releases the gradients it reduces.

[Note: recomputation] Activation checkpointing recomputes a forward inside backward. Where it runs
inside the unit's call (the hooks stay outside) the hooks do not run again. Where it runs around
the unit's call, the pre-forward hook sees a backward in progress: it only makes sure the
parameters are gathered, registers nothing and counts nothing, and the post-forward hook does not
reshard (the backward still needs them).

[Note: prefetching] The units of one root share a Schedule: the order in which their forwards
began in the root's last forward call. Each unit's pre-forward issues the all-gather of the unit
after it in that order (asynchronously) before its own forward computes, and each unit's
pre-backward issues the all-gather of the unit before it, whose backward comes next. So a unit
computes while the next one's parameters travel, and at most two units are unsharded at once
besides those whose forward encloses them (the root). The first forward has no recorded order
and so no prefetching. A prefetched unit that is never used in a backward is resharded by the
final callback, which its prefetch queues. Every rank issues the same collectives in the same
order: the order is the model's, not the data's. FSDP2's ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch`` (module.py) replace the recorded neighbour by the units given.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .group import ParamGroup
from .param import ShardState


class TrainingState(Enum):
    IDLE = auto()  # between steps, or forward done with no backward pending
    FORWARD = auto()  # inside the unit's forward
    PRE_BACKWARD = auto()  # backward has reached the unit's outputs; parameters gathered again


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Schedule:
    """The forward order of the units under one root (see [Note: prefetching])."""

    def __init__(self, root: UnitState):
        self.root = root
        self.order: list[UnitState] = []  # forward calls of the root's last complete forward, in order
        self._first: dict[int, int] = {}  # id(unit) -> index of its first call in `order`
        self._recording: list[UnitState] | None = None  # while the root's forward runs
        self._prefetched: list[UnitState] = []  # gathered ahead in this forward, not yet started

    def started(self, unit: UnitState) -> UnitState | None:
        """`unit`'s forward begins; returns the unit whose forward came next last time."""
        if unit is self.root:
            self._recording = []
        if self._recording is None:  # a unit called outside its root's forward
            return None
        if unit in self._prefetched:
            self._prefetched.remove(unit)
        i = len(self._recording)
        self._recording.append(unit)
        return self.order[i + 1] if i + 1 < len(self.order) and self.order[i] is unit else None

    def prefetched(self, unit: UnitState) -> None:
        self._prefetched.append(unit)

    def finished(self, unit: UnitState) -> None:
        """`unit`'s forward ended; at the root's, the order is kept and unused prefetches freed."""
        if unit is not self.root or self._recording is None:
            return
        self.order, self._recording = self._recording, None
        self._first = {}
        for i, u in enumerate(self.order):
            self._first.setdefault(id(u), i)
        for u in self._prefetched:  # this forward took another path than the last one
            u.params.reshard()
        self._prefetched = []

    def before(self, unit: UnitState) -> UnitState | None:
        """The unit whose forward came just before `unit`'s (first) one: its backward comes next."""
        i = self._first.get(id(unit))
        return self.order[i - 1] if i else None


class UnitState:
    """Attached to each module passed to fully_shard as ``module._fsdp_state``."""

    def __init__(
        self, module: nn.Module, params: ParamGroup, reshard_after_forward: bool | None, param_dtype: torch.dtype | None
    ):
        self.module = module
        self.params = params
        self.reshard_after_forward = reshard_after_forward  # None: at every unit but the schedule's root
        self.reshard_after_backward = True  # False: stay gathered after backward (module.py)
        self.is_last_backward = True  # FSDP2's flag: kept, changes nothing here (module.py)
        # units to prefetch, set by FSDP2's set_modules_to_*_prefetch; None: the recorded order's neighbour
        self.forward_prefetch: list[UnitState] | None = None
        self.backward_prefetch: list[UnitState] | None = None
        self.param_dtype = param_dtype
        self.schedule = Schedule(self)  # until a fully_shard of an ancestor adopts this unit
        self.training_state = TrainingState.IDLE
        self._callback_queued = False
        self._pending_calls = 0  # forward calls whose PostBackward has not run yet
        self._untracked_call = False  # a forward call with no input requiring grad (only the callback sees it)
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        # state_dict() / load_state_dict() see the sharded DTensors, whenever they are called
        module.register_state_dict_pre_hook(self._to_sharded)
        module.register_load_state_dict_pre_hook(self._to_sharded)

    def _to_sharded(self, *args, **kwargs) -> None:
        self.params.reshard()

    # -- forward --------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        self.params.unshard()
        if self.param_dtype is not None:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        if _in_backward():  # a recomputation (see the note)
            return args, kwargs
        nxt = self.schedule.started(self)
        for unit in self.forward_prefetch if self.forward_prefetch is not None else [nxt]:
            if _prefetch(unit):
                unit.schedule.prefetched(unit)  # freed at its root's forward end should it not run
        self.training_state = TrainingState.FORWARD
        if torch.is_grad_enabled() and self.params.params:
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
            return x.to(self.param_dtype)
        return x

    def _register_post_backward(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            self._untracked_call = True
            return args, kwargs
        for i, t in zip(where, PostBackward.apply(self, *[flat[i] for i in where])):
            flat[i] = t
        self._pending_calls += 1
        return tree_unflatten(flat, spec)

    def _post_forward(self, module, args, output):
        if _in_backward():
            return output
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        reshard = self.reshard_after_forward
        if reshard is None:  # FSDP2's default: the root stays gathered, its backward comes first
            reshard = self.schedule.root is not self
        if not torch.is_grad_enabled():  # no backward will come to regather: reshard fully
            self.params.reshard()
        elif reshard:  # to the post-forward group where there is one (group.py)
            self.params.reshard(after_forward=True)
        self.schedule.finished(self)
        self.training_state = TrainingState.IDLE
        return output

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward(self, grad):
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self.training_state = TrainingState.PRE_BACKWARD
            self.params.unshard()
            self._queue_final_callback()
            before = self.schedule.before(self)
            for nxt in self.backward_prefetch if self.backward_prefetch is not None else [before]:
                if nxt is not None and nxt.training_state is not TrainingState.PRE_BACKWARD:
                    if _prefetch(nxt):
                        nxt._queue_final_callback()  # reshards it should its backward never come
        return grad

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def _post_backward(self) -> None:
        """PostBackward of one forward call ran: at the last tracked call, reduce and reshard."""
        self._pending_calls = max(self._pending_calls - 1, 0)
        if self._pending_calls == 0 and not self._untracked_call:
            self._finish()

    def _finish(self) -> None:
        if self.params.sync_grads:
            self.params.reduce_grads()
        else:
            self.params.hold_grads()
        # batch-invariant steps keep units gathered between micro-batches; so does set_reshard_after_backward(False)
        if self.reshard_after_backward and not self.params.keep_gathered:
            self.params.reshard()

    def _final_callback(self) -> None:
        self._finish()  # what is left: untracked calls, late gradients; a no-op after _post_backward
        self._callback_queued = False
        self._pending_calls = 0
        self._untracked_call = False
        self.training_state = TrainingState.IDLE


def _prefetch(unit: UnitState | None) -> bool:
    """Issue `unit`'s all-gather unless its parameters are gathered or on their way."""
    if unit is None or unit.params.state is not ShardState.SHARDED or unit.params.gathering:
        return False
    unit.params.unshard(async_op=True)
    return True


class PostBackward(torch.autograd.Function):
    """Identity on the unit's grad-requiring inputs; its backward tells the unit that autograd is
    done with the call (see [Note: when a unit's gradient is complete])."""

    @staticmethod
    def forward(ctx, state: UnitState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state._post_backward()
        return (None, *grads)


# Traversal #


def units(module: nn.Module):
    """(prefix, UnitState) for every sharded unit under `module`, in module order."""
    for prefix, sub in module.named_modules():
        state = getattr(sub, "_fsdp_state", None)
        if state is not None:
            yield prefix, state


def sharded_params(module: nn.Module):
    """(full name under `module`, ShardedParam) for every sharded parameter, unit by unit."""
    for prefix, state in units(module):
        for p in state.params.params:
            yield join_name(prefix, p.fqn), p


def join_name(prefix: str, name: str) -> str:
    """`name` under the module at `prefix` ('' for the root)."""
    return f"{prefix}.{name}" if prefix else name
