"""FSDPModule: the methods FSDP2 puts on a sharded module, on fsdp_impl's units.

``fully_shard`` makes the module it shards an instance of ``FSDP<its class>``, a subclass made once
per class with ``FSDPModule`` first in its bases (as FSDP2 does), so code written for FSDP2 calls the
same methods on it:

    model.set_requires_gradient_sync(False)       # accumulate unreduced (every unit below; recurse=False: this one)
    block.unshard(async_op=True).wait() / block.reshard()    # this unit only, as FSDP2 (not recursive)
    model.set_reshard_after_forward(False)        # bool, as FSDP2's method takes (every unit below)
    model.set_reshard_after_backward(False)       # keep units gathered after backward (accumulation)
    model.set_is_last_backward(True)              # accepted; nothing to wait for (see the method)
    block.set_modules_to_forward_prefetch([next_block])    # explicit prefetching, instead of the
    block.set_modules_to_backward_prefetch([prev_block])   # recorded order (state.py, [Note: prefetching])

The instance keeps its attributes (``_fsdp_state`` above all) and its original class's behaviour; only
methods are added. ``isinstance(m, fsdp_impl.FSDPModule)`` tells a unit. Not added, because fsdp_impl's
reduction is fixed by design (collectives.py: one division by W in a rank-ordered sum): the
divide-factor and custom-collective hooks (``set_gradient_divide_factor``, ``set_custom_reduce_scatter``,
...), ``set_requires_all_reduce`` (HSDP's two reductions are one exchange here), and the CUDA-stream
hooks (``set_post_optim_event``, ``set_all_reduce_hook``).
"""

from __future__ import annotations

from torch import nn

_CLASSES: dict[type, type] = {}  # original class -> its FSDP subclass


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` completes the all-gather (the unit's next
    forward waits for it anyway)."""

    def __init__(self, params):
        self._params = params

    def wait(self) -> None:
        self._params.wait_unshard()


class FSDPModule:
    """Mixed into each module ``fully_shard`` shards (first in its class's bases)."""

    def __new__(cls, *args, **kwargs):
        """Construction through the class (``type(self)(...)``, as container slicing does) builds the
        ORIGINAL class: a new module is not sharded. Without arguments (copy, pickle) the class stays."""
        if not args and not kwargs:
            return super().__new__(cls)
        orig = original_class(cls)
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise TypeError(
            "a module sharded by fsdp_impl cannot be deep-copied (it holds process groups); build "
            "a new model and load full_state_dict(model) into it"
        )

    # -- this unit ------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters (collective over its shard group; not recursive). With `async_op`
        the all-gather is only issued: the returned handle's ``wait()``, or the unit's forward, completes it.
        The unit stays gathered until its forward reshards it (as ``reshard_after_forward`` says) or
        ``reshard()``."""
        params = self._fsdp_state.params
        params.unshard(async_op=async_op)
        return UnshardHandle(params) if async_op else None

    def reshard(self) -> None:
        """Free this unit's gathered parameters; the modules point at the shards again (not recursive)."""
        self._fsdp_state.params.reshard()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2's training loops. FSDP2 waits for its outstanding gradient reductions at the
        end of the last backward; fsdp_impl completes every reduction inside the backward that issues it,
        so there is never one to wait for and the flag changes nothing."""
        self._fsdp_state.is_last_backward = bool(is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """The units whose all-gathers this unit issues (asynchronously) before its forward computes,
        instead of the next unit of the recorded forward order. Every rank must give the same list."""
        self._fsdp_state.forward_prefetch = _states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """The units whose all-gathers this unit issues when its backward begins, instead of the unit
        whose forward came before its own. Every rank must give the same list."""
        self._fsdp_state.backward_prefetch = _states(modules, "set_modules_to_backward_prefetch")

    # -- this unit and (recurse) every unit below ---------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Gradient reduction off (False: each unit keeps its unreduced gradients and later backward
        passes add to them) or back on (True: the next backward reduces the sum once). Under HSDP both
        reductions are skipped. As ``fsdp_impl.set_requires_gradient_sync(module, flag)``."""
        for state in self._states(recurse):
            state.params.sync_grads = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """True: free the unit's gathered parameters after its forward (backward gathers again); False:
        keep them until backward. A bool, as FSDP2's method takes (an int g only at ``fully_shard``)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: a bool, not {reshard_after_forward!r}")
        states = self._states(recurse)
        if any(state.params._kept is not None for state in states):
            raise ValueError(
                "set_reshard_after_forward: a unit is between its forward and its backward; change it between steps"
            )
        for state in states:
            state.reshard_after_forward = reshard_after_forward
            state.params.post_forward_group = None  # True reshards fully, to the shard group

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: units stay gathered after backward, so the next forward gathers nothing (accumulation
        over micro-batches with no optimizer step between). Set it back to True (or ``reshard()``) before
        the optimizer steps: a unit left gathered computes with the parameters it gathered."""
        for state in self._states(recurse):
            state.reshard_after_backward = bool(reshard_after_backward)

    def _states(self, recurse: bool) -> list:
        if not recurse:
            return [self._fsdp_state]
        return [m._fsdp_state for m in self.modules() if getattr(m, "_fsdp_state", None) is not None]


def make_fsdp_module(module: nn.Module) -> None:
    """Give `module` FSDPModule's methods: its class becomes ``FSDP<class>`` (made once per class)."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    module.__class__ = _CLASSES[cls]


def original_class(cls: type) -> type:
    """The class a module had before fully_shard (`cls` itself for any other)."""
    return cls.__mro__[2] if issubclass(cls, FSDPModule) and cls is not FSDPModule else cls


def _states(modules, who: str) -> list:
    states = [getattr(m, "_fsdp_state", None) for m in modules]
    if any(s is None for s in states):
        raise ValueError(f"{who}: every module must have been passed to fully_shard")
    return states
