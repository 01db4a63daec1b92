"""How a mutant injects its fault: into the objects of the one model it wraps, and nowhere else.

Worker processes are reused for many scenarios, so a mutant never patches a class or a module.
Faults are injected in three ways:

- ``rebind(group, "reduce_grads", reduce_scatter_mean=f)``: the product's own method, bound to
  this ``ParamGroup`` (one unit's parameters) only, with one module-level name it calls replaced (a
  copy of the function with its globals changed; the product code runs unchanged around the fault);
- instance attributes on a ``ParamGroup`` / ``ShardedParam`` / ``UnitState`` (``group.reduce_grads``
  wrapped, ``p.add_reduced_grad``, ``state.reshard_after_forward``), which shadow the class's for
  that object only;
- a different ``wrap`` / ``make_optimizer`` / ``after_backward`` in the adapter.

The injection points are the ones a refactor of the product's internals is least likely to move:
the functions of ``fsdp_impl/collectives.py`` (by the name the product's method calls them),
``ShardedParam`` methods, ``ParamGroup.reduce_grads`` / ``reshard`` / ``unshard`` (each replaced or
wrapped as a whole method), and the ``UnitState`` hooks.

``MutantAdapter`` is the base of the mutants: ``fsdp_impl`` whose ``mutate`` injects the fault
into the wrapped model.
"""

from __future__ import annotations

import types

from torch import nn

from harness.adapters.base import AdapterError
from harness.adapters.fsdp_impl import FsdpImplAdapter


def unit_states_of(wrapped: nn.Module):
    """(prefix, UnitState) of every fully_shard unit under `wrapped`."""
    from fsdp_impl.state import units

    return list(units(wrapped))


def param_groups_of(wrapped: nn.Module):
    """(unit prefix, ParamGroup) of every unit that holds parameters."""
    return [(prefix, state.params) for prefix, state in unit_states_of(wrapped) if state.params.params]


def sharded_params_of(wrapped: nn.Module):
    """(full name under `wrapped`, ShardedParam) of every sharded parameter, unit by unit."""
    from fsdp_impl.state import sharded_params

    return list(sharded_params(wrapped))


def _names_used(code: types.CodeType) -> set[str]:
    """Global names a function's code (and the code of functions nested in it) refers to."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names_used(const)
    return out


def with_globals(fn: types.FunctionType, **names) -> types.FunctionType:
    """A copy of `fn` that sees `names` instead of the module-level objects of the same name."""
    missing = [n for n in names if n not in fn.__globals__ or n not in _names_used(fn.__code__)]
    if missing:  # the product was refactored: say which hook this mutant can no longer reach
        raise AdapterError(
            f"mutant: {fn.__module__}.{fn.__qualname__} no longer refers to {missing}; "
            f"update the mutant in suites/mutants/"
        )
    g = dict(fn.__globals__)
    g.update(names)
    out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def rebind(obj: object, method: str, **names) -> None:
    """Set ``obj.<method>`` (this object only) to the class's method with `names` replaced."""
    fn = getattr(type(obj), method, None)
    if not isinstance(fn, types.FunctionType):
        raise AdapterError(f"mutant: {type(obj).__name__}.{method} is gone; update the mutant in suites/mutants/")
    setattr(obj, method, types.MethodType(with_globals(fn, **names), obj))


def around(obj: object, method: str, fn) -> None:
    """Set ``obj.<method>`` (this object only) to ``fn(product, *args, **kwargs)``, where `product` is
    the method as the object had it (bound): the fault runs around the product's own method."""
    product = getattr(obj, method, None)
    if not callable(product):
        raise AdapterError(f"mutant: {type(obj).__name__}.{method} is gone; update the mutant in suites/mutants/")

    def around(*args, **kwargs):
        return fn(product, *args, **kwargs)

    setattr(obj, method, around)


def collectives_module():
    from fsdp_impl import collectives

    return collectives


class MutantAdapter(FsdpImplAdapter):
    """fsdp_impl with a fault injected by ``mutate`` into the wrapped model's own objects."""

    name = "mutant"

    def _shard(self, model: nn.Module, units: list[nn.Module], device, **options) -> nn.Module:
        wrapped = super()._shard(model, units, device, **options)  # every wrap (plain, mixed, hybrid) ends here
        self.mutate(wrapped)
        return wrapped

    def mutate(self, wrapped: nn.Module) -> None:
        """Inject the fault into `wrapped`'s own objects (mutants that fault elsewhere leave it)."""


class ReductionReplaced(MutantAdapter):
    """fsdp_impl whose post-backward gradient reduction (``ParamGroup.reduce_grads``) calls ``reduce``
    instead of the product's ``reduce_scatter_mean`` (which ``reduce`` receives as ``mean`` and may
    call). `full_grad` is the unit's flat buffer of W equal chunks, chunk r every parameter's rows for
    rank r (zero rows padding each parameter's last chunks); ``reduce`` returns this rank's chunk."""

    def reduce(self, mean, full_grad, group, reduce_dtype):
        raise NotImplementedError

    def mutate(self, wrapped):
        mean = collectives_module().reduce_scatter_mean

        def replaced(full_grad, group, reduce_dtype, out_dtype=None):  # the result is cast as any dtype
            return self.reduce(mean, full_grad, group, reduce_dtype)

        for _, g in param_groups_of(wrapped):
            rebind(g, "reduce_grads", reduce_scatter_mean=replaced)
