"""Meta-device init: the control that must match eager init bitwise, and the mutant that
replays the modules in another order.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.adapters.fsdp_impl import FsdpImplAdapter


class MetaInit(FsdpImplAdapter):
    """CONTROL, not a mutant: the model rebuilt on the meta device, sharded, then materialized by
    fsdp_impl.materialize_meta with the seed the harness used, so it must match eager init bitwise."""

    name = "control:meta_init"

    def wrap(self, model, units, *, group, device):
        from fsdp_impl import fully_shard, materialize_meta

        seed, rng = torch.initial_seed(), torch.get_rng_state()  # harness: manual_seed(seed); build()
        fresh: dict[int, nn.Parameter] = {}
        for m in model.modules():  # every parameter to meta, ties kept
            for n, p in list(m._parameters.items()):
                if p is not None:
                    if id(p) not in fresh:
                        fresh[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                    m._parameters[n] = fresh[id(p)]
        for unit in units:
            fully_shard(unit, process_group=group)
        fully_shard(model, process_group=group)
        torch.manual_seed(seed)
        self.materialize(model, materialize_meta, device)
        torch.set_rng_state(rng)
        return model

    def materialize(self, model, materialize_meta, device):
        materialize_meta(model, device)


class MetaInitRngOrder(MetaInit):
    """Meta init replaying modules in a different order than eager construction (last module
    first): every parameter draws other random numbers than the eager model's."""

    name = "mutant:meta_init_rng_order"

    def materialize(self, model, materialize_meta, device):
        eager_order = list(type(model).named_modules(model))
        model.named_modules = lambda *a, **k: iter(reversed(eager_order))
        try:
            materialize_meta(model, device)
        finally:
            del model.named_modules
