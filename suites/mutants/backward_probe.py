"""A fault inside the backward, for the localiser's test (suites/mutants/test_localize.py): not a catalogue
mutant (no harness check is built around it), a probe that only an op-by-op comparison of the backward names.

``backward_regather_nudged`` is fsdp_impl whose backward re-gather hands one unit's weight to the backward
one ulp off in a single element, on the last rank of two or more only: the forward computes with the exact
weight, the backward's ``mm`` of that unit (the gradient of its input, read with the weight) with the nudged
one. The gradients that reach the reduction are off by about that ulp times the incoming gradient, which a
reduction's own rounding can hide; the first op that differs is the backward's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from suites.mutants.injection import MutantAdapter, around, unit_states_of

UNIT = "layers.1"  # the mlp's middle unit: its input needs a gradient, so its backward reads its weight


class BackwardRegatherNudged(MutantAdapter):
    name = "mutant:backward_regather_nudged"

    def mutate(self, wrapped):
        if dist.get_world_size() < 2:
            return
        last = dist.get_rank() == dist.get_world_size() - 1
        for prefix, state in unit_states_of(wrapped):
            if prefix == UNIT and last:
                around(state, "_pre_backward", self._nudged(state))

    @staticmethod
    def _nudged(state):
        def pre_backward(product, grad):
            first = state.training_state.name != "PRE_BACKWARD"
            out = product(grad)  # the product's own: re-gathers the unit for its backward
            if first:
                weight = state.params.params[0].unsharded
                # .data: a write the autograd version counter does not see, as a collective's copy-out
                flat = weight.data.view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, dtype=flat.dtype))
            return out

        return pre_backward


backward_regather_nudged = BackwardRegatherNudged
