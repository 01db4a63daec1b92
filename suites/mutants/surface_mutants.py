"""Faults of FSDP2's wider surface as fsdp_impl has it: an integer reshard_after_forward (feature
reshard2) that reshards fully after forward, or keeps every unit gathered (neither changes a number; only
a run that asks for resharding to a smaller group shows them, in its traffic or its memory); a parameter
sharded on dim 1 (feature shard1) copied out of the all-gather as if sharded on dim 0."""

from __future__ import annotations

from suites.mutants.injection import MutantAdapter, param_groups_of


class PostForwardFullReshard(MutantAdapter):
    """Asked for reshard_after_forward=g, each unit reshards fully after forward (the post-forward group
    dropped), so backward regathers it over the whole shard group: (W - 1) / W of it on the wire, not
    (g - 1) / g, and the memory the option trades for that traffic is saved for nothing (traffic only)."""

    name = "mutant:post_forward_full_reshard"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            g.post_forward_group = None


class PostForwardKeptGathered(MutantAdapter):
    """Asked for reshard_after_forward=g, each unit stays gathered after forward (as with False): backward
    needs no regather, and every unit is held in full from its forward to its backward (memory only)."""

    name = "mutant:post_forward_kept_gathered"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            if g.post_forward_group is not None:
                reshard = g.reshard
                g.reshard = lambda after_forward=False, reshard=reshard: None if after_forward else reshard()


class ColumnsAsRows(MutantAdapter):
    """A parameter sharded on dim 1 is copied out of the all-gather as if it were sharded on dim 0: rank r's
    columns written at rank r's row offset (the chunks laid end to end in the flat buffer), so the gathered
    matrix holds the right values in the wrong places. A Shard(0) parameter is untouched (plain runs pass),
    and at one rank the two layouts coincide."""

    name = "mutant:columns_as_rows"

    def mutate(self, wrapped):
        from suites.mutants.injection import sharded_params_of

        for _, p in sharded_params_of(wrapped):
            if p.dim != 0:
                alloc = p.alloc_unsharded

                def as_rows(p=p, alloc=alloc):
                    alloc()  # (re)allocates the storage
                    return p._unsharded_data.view(p.world_size, p.shard_numel)

                p.alloc_unsharded = as_rows


class OffloadStaleHostCopy(MutantAdapter):
    """Under a CPU offload policy the all-gathers read a host copy of each shard made at wrapping, while the
    optimizer steps the shard the DTensor parameter holds: every forward computes with the initial
    parameters, and the full parameters reported are those too. Without offload nothing changes (the copy
    is made for offloaded shards only), so only an offload run shows it."""

    name = "mutant:offload_stale_host_copy"

    def mutate(self, wrapped):
        from suites.mutants.injection import sharded_params_of

        for _, p in sharded_params_of(wrapped):
            if p.offload is not None:
                p.padded = p.padded.clone()  # the gathers' source; the optimizer's shard is the original
