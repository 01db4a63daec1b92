"""Faults of FSDP2's wider surface as fsdp_impl has it: an integer reshard_after_forward (feature
reshard2) that reshards fully after forward, or keeps every unit gathered. Neither changes a number;
only a run that asks for resharding to a smaller group shows them, in its traffic or its memory."""

from __future__ import annotations

from suites.mutants.injection import MutantAdapter, _groups


class PostForwardFullReshard(MutantAdapter):
    """Asked for reshard_after_forward=g, each unit reshards fully after forward (the post-forward group
    dropped), so backward regathers it over the whole shard group: (W - 1) / W of it on the wire, not
    (g - 1) / g, and the memory the option trades for that traffic is saved for nothing (traffic only)."""

    name = "mutant:post_forward_full_reshard"

    def mutate(self, wrapped):
        for _, g in _groups(wrapped):
            g.post_forward_group = None


class PostForwardKeptGathered(MutantAdapter):
    """Asked for reshard_after_forward=g, each unit stays gathered after forward (as with False): backward
    needs no regather, and every unit is held in full from its forward to its backward (memory only)."""

    name = "mutant:post_forward_kept_gathered"

    def mutate(self, wrapped):
        for _, g in _groups(wrapped):
            if g.post_forward_group is not None:
                reshard = g.reshard
                g.reshard = lambda after_forward=False, reshard=reshard: None if after_forward else reshard()
