"""The catalogue of injectable faults ("mutants") over fsdp_impl: what each breaks, which check
must catch it, and the matrix that exposes it.

A verification harness is only as good as the bugs it catches. Every mutant is the ``fsdp_impl``
adapter with ONE realistic fault injected into the objects of the model it wraps, and nowhere
else (``injection.py`` says how). The mutants live beside this module, grouped by what they break:

- ``gradient_mutants``: the gradient's scale and precision, and which parameters get one;
- ``sharding_mutants``: shard offsets, padding, views, the unit and rank a shard belongs to;
- ``memory_mutants``: faults that change memory only, not the numbers;
- ``meta_init_mutants``: meta-device init (and the control it is judged against);
- ``per_sample_mutants``: per-sample gradient norms (a world task, not an adapter);
- ``feature_mutants``: the training features (gradient accumulation with the reduction switched off,
  clipping);
- ``timing_mutants``: faults that show only when asynchronous work finishes late (feature ``jitter``);
- ``optimizer_mutants``: a per-matrix optimizer applied to each rank's shard instead of the whole matrix;
- ``hidden_mutants``: faults hidden from what an adapter reports (a parameter left out of
  ``full_params``, buffers and state outside the reported objects, traffic from another thread),
  and the controls that reduce gradients ZeRO-1/2 style.

``CATALOGUE`` lists each mutant with the check expected to catch it and the matrix that exposes
it; ``CONTROLS`` are unmutated adapters run beside them (a mutant's failure must come from its
fault, not from the way it is injected). Every adapter is loaded by its name in this module
(``suites.mutants.catalog:grad_summed``), which is also its scenario id in the reports.
``reports/mutation_score.py`` runs them all in one matrix.

A mutant that escapes is a gap in the harness: the answer is a sharper check or scenario, never a
weaker mutant. ``grad_norm_matches``, ``peak_params_bound``, ``units_gathered`` and the ``mlp_frozen`` model
came from mutants that once escaped or were caught too narrowly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.core.names import MODELS as ZOO
from suites.mutants.engine_mutants import EngineBoundaryOffByOne, EngineClipByPartition, EngineLossScaledTwice
from suites.mutants.feature_mutants import (
    AccumAveraged,
    AcReducedTwice,
    Bf16OptimizerStep,
    Bf16Summed,
    CkptLastRankShifted,
    CkptOptimizerStateShifted,
    CkptStepRestarted,
    ClipLocalNorm,
    ClipNormReportedLocal,
    HeldInParamDtype,
    ReplicasNotAveraged,
    SyncIgnored,
    SyncNeverRestored,
)
from suites.mutants.gradient_mutants import (
    AveragedTwice,
    Fp32Reduce,
    FrozenUpdated,
    GradOverwritten,
    GradsNotCleared,
    GradSummed,
    LastRankNegated,
    LastRankScaledInput,
    LowPrecisionReduce,
    TiedReducedTwice,
)
from suites.mutants.hidden_mutants import (
    GatherToOwners,
    OptimizerDelegated,
    OptimizerShadowState,
    ParamLeftOut,
    PrefetchThreadGather,
    ReducedToWrongOwner,
    ReduceToOwners,
    UnitBufferKept,
)
from suites.mutants.memory_mutants import NoGradForwardUnsharded, OptimizerStateUnsharded, ReshardSkipped
from suites.mutants.meta_init_mutants import MetaInit, MetaInitRngOrder
from suites.mutants.optimizer_mutants import ShardNormalised
from suites.mutants.per_sample_mutants import per_sample_task  # noqa: F401 (named by a spec below)
from suites.mutants.sharding_mutants import (
    NestedDuplication,
    PaddingInView,
    PaddingNotZeroed,
    StaleShard,
    TailBeforeLastDropped,
    TieBroken,
    WrongShardOffset,
)
from suites.mutants.surface_mutants import (
    ColumnsAsRows,
    OffloadStaleHostCopy,
    PostForwardFullReshard,
    PostForwardKeptGathered,
)
from suites.mutants.timing_mutants import GatherReadEarly

MODULE = __name__
NORMALISED_SGD = "harness.train.optim:normalised_sgd"  # the zoo's per-matrix optimizer (--optimizers)


@dataclass(frozen=True)
class Mutant:
    name: str
    spec: str  # adapter "package.module:object", or the world task for per-sample mutants
    expected: str  # the harness check that must catch it
    what: str  # the bug it models
    models: tuple[str, ...] = ("mlp",)
    data_modes: tuple[str, ...] = ("replicated", "split")
    optimizers: tuple[str, ...] = ("adamw", "sgd")
    world_sizes: tuple[int, ...] = (1, 2)
    steps: int = 3
    # first step at which a numeric check must see it, as (earliest, latest): the fault cannot act
    # before `earliest`; `latest` is the step by which the fault has changed an update directly
    at_steps: tuple[int, int] | None = (1, 1)
    kind: str = "numeric"  # "numeric" | "memory" | "traffic" | "per_sample" | "report" (what a rank says)
    # the fault sits in one rank's path (the last rank's, at W > 1): each catching verdict names that rank
    one_rank: bool = False
    features: tuple[str, ...] = ("plain",)  # what a step does (harness.core.features.FEATURES)
    slow: bool = False  # behind @pytest.mark.slow (none is: the whole catalogue runs in ~1 minute)


def _spec(name: str) -> str:
    return f"{MODULE}:{name}"


# the names adapters are loaded by ("suites.mutants.catalog:grad_summed"): readable scenario ids
grad_summed, averaged_twice, bf16_reduce = GradSummed, AveragedTwice, LowPrecisionReduce
last_rank_negated, last_rank_scaled_input = LastRankNegated, LastRankScaledInput
tied_reduced_twice, grads_not_cleared, frozen_updated = TiedReducedTwice, GradsNotCleared, FrozenUpdated
wrong_shard_offset, padding_not_zeroed, padding_in_view = WrongShardOffset, PaddingNotZeroed, PaddingInView
nested_duplication, stale_shard, reshard_skipped = NestedDuplication, StaleShard, ReshardSkipped
optimizer_state_unsharded, meta_init, meta_init_rng_order = OptimizerStateUnsharded, MetaInit, MetaInitRngOrder
param_left_out, unit_buffer_kept, optimizer_shadow_state = ParamLeftOut, UnitBufferKept, OptimizerShadowState
prefetch_thread_gather, reduce_to_owners, gather_to_owners = PrefetchThreadGather, ReduceToOwners, GatherToOwners
fp32_reduce, tie_broken, optimizer_delegated = Fp32Reduce, TieBroken, OptimizerDelegated
grad_overwritten = GradOverwritten
sync_ignored, sync_never_restored, accum_averaged = SyncIgnored, SyncNeverRestored, AccumAveraged
clip_local_norm, bf16_optimizer_step, ac_reduced_twice = ClipLocalNorm, Bf16OptimizerStep, AcReducedTwice
clip_norm_reported_local, held_in_param_dtype = ClipNormReportedLocal, HeldInParamDtype
bf16_summed, shard_normalised = Bf16Summed, ShardNormalised
replicas_not_averaged = ReplicasNotAveraged
no_grad_forward_unsharded = NoGradForwardUnsharded
gather_read_early = GatherReadEarly
ckpt_last_rank_shifted, ckpt_optimizer_state_shifted = CkptLastRankShifted, CkptOptimizerStateShifted
ckpt_step_restarted = CkptStepRestarted
tail_before_last_dropped = TailBeforeLastDropped
post_forward_full_reshard, post_forward_kept_gathered = PostForwardFullReshard, PostForwardKeptGathered
columns_as_rows = ColumnsAsRows
offload_stale_host_copy = OffloadStaleHostCopy
engine_boundary_off_by_one, engine_loss_scaled_twice = EngineBoundaryOffByOne, EngineLossScaledTwice
engine_clip_by_partition = EngineClipByPartition
reduced_to_wrong_owner = ReducedToWrongOwner


# World size 1 runs the same gradient path as W > 1 (the gradient lands in the unsharded parameter and
# reaches the sharded one through the unit's reduction, a cast at W = 1: per-parameter sharding has no
# zero-copy path at W = 1). A fault on that path therefore acts at W = 1 too, where ws1_exact holds the
# run bitwise to the plain model; replicated data at W > 1 then reproduces the faulty W = 1 run, so the
# checks against W = 1 (cross_ws_replicated, grads_match_ws1) cannot see it. Padding exists at W > 1 only
# (rows of the last ranks' chunks): a padding fault is held to W = 1 by cross_ws_replicated.
CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "grad_summed",
        _spec("grad_summed"),
        "cross_ws_replicated",
        "gradients summed over ranks, not averaged (division by W missing)",
        world_sizes=(1, 2, 4),
    ),
    Mutant(
        "last_rank_negated",
        _spec("last_rank_negated"),
        "cross_ws_replicated",
        "the last rank's reduced gradient comes back negated (one rank's path only)",
        world_sizes=(1, 2, 4),
        one_rank=True,
    ),
    Mutant(
        "last_rank_scaled_input",
        _spec("last_rank_scaled_input"),
        "cross_ws_replicated",
        "the last rank's gradient doubled before the reduction (one rank's local gradient wrong)",
        world_sizes=(1, 4),
        one_rank=True,
    ),
    Mutant("averaged_twice", _spec("averaged_twice"), "cross_ws_replicated", "gradients divided by W twice"),
    Mutant(
        "wrong_shard_offset",
        _spec("wrong_shard_offset"),
        "cross_ws_replicated",
        "rank r's rows of each parameter start at r x floor(R/W) instead of r x ceil(R/W): misplaced parameters",
        world_sizes=(1, 2, 4),
    ),
    # W = 8: the only layout of the zoo with a short chunk before the last rank (tied_vocab33's 33 rows: rank 6
    # holds rows 30-32, rank 7 none); at 2 and 4 ranks, and on every other model, the short chunk is the last
    # rank's and the mutant changes nothing
    Mutant(
        "tail_before_last_dropped",
        _spec("tail_before_last_dropped"),
        "rows_trained",
        "an uneven parameter's short chunk assumed to be the last rank's: where a rank before the last holds "
        "fewer rows than the others (and more than none), its gradient is dropped as padding and the "
        "optimizer never moves its rows",
        models=("tied_vocab33",),
        data_modes=("replicated",),
        world_sizes=(1, 8),
    ),
    Mutant(
        "padding_not_zeroed",
        _spec("padding_not_zeroed"),
        "grad_norm_matches",
        "padding rows kept in the last ranks' shards, never zeroed and fed stale memory by the reduce buffer: "
        "the optimizer writes values into them, which leak into the gradient norm",
    ),
    Mutant(
        "padding_in_view",
        _spec("padding_in_view"),
        "cross_ws_replicated",
        "unsharded parameters read at packed offsets out of the padded all-gather: a parameter's padding "
        "rows leak into the unsharded view of the next parameter",
    ),
    Mutant(
        "nested_duplication",
        _spec("nested_duplication"),
        "memory_sharding",
        "a parameter in two units: the root shards the blocks' parameters again",
        at_steps=None,
        kind="memory",
    ),
    # counted in units, so it fails on every model; a peak bound in bytes that allows two units
    # unsharded exceeds the whole mlp (3 units) and saw it on tinylm only, by about 1%
    Mutant(
        "reshard_skipped",
        _spec("reshard_skipped"),
        "units_gathered",
        "no reshard after forward: every unit stays unsharded until its backward (memory only)",
        models=("mlp", "tinylm", "tinylm_tied"),
        data_modes=("replicated",),
        at_steps=None,
        kind="memory",
    ),
    # only a forward under no_grad shows it: the eval feature's, after the optimizer step (no other feature
    # runs one; suites/mutants/test_eval_mutant.py runs it through each of them)
    Mutant(
        "no_grad_forward_unsharded",
        _spec("no_grad_forward_unsharded"),
        "units_gathered",
        "no reshard after a forward under torch.no_grad() (an evaluation pass): every unit stays gathered "
        "until the next training backward (memory only; pytorch #149029)",
        data_modes=("replicated",),
        optimizers=("adamw",),
        at_steps=None,
        kind="memory",
        features=("eval",),
    ),
    # only an integer reshard_after_forward (reshard2) asks for a post-forward group, and only at W > 2 is it
    # smaller than the shard group (W = 1 runs beside as the comparison run)
    Mutant(
        "post_forward_full_reshard",
        _spec("post_forward_full_reshard"),
        "comm_volume",
        "asked to reshard to groups of 2 ranks after forward, it reshards fully: backward regathers over "
        "all W ranks (traffic only)",
        data_modes=("replicated",),
        optimizers=("adamw",),
        world_sizes=(1, 4),
        at_steps=None,
        kind="traffic",
        features=("reshard2",),
    ),
    Mutant(
        "post_forward_kept_gathered",
        _spec("post_forward_kept_gathered"),
        "units_gathered",
        "asked to reshard to groups of 2 ranks after forward, it keeps every unit gathered until its "
        "backward (memory only)",
        data_modes=("replicated",),
        optimizers=("adamw",),
        world_sizes=(1, 4),
        at_steps=None,
        kind="memory",
        features=("reshard2",),
    ),
    # only a placement on another dim than 0 (shard1) has a parameter it acts on, on a model with a dim 1 that
    # divides evenly (tinylm; the mlp's widths are odd), and only at W > 1 do the two layouts differ
    Mutant(
        "columns_as_rows",
        _spec("columns_as_rows"),
        "cross_ws_replicated",
        "a parameter sharded on dim 1 copied out of the all-gather as if sharded on dim 0: each rank's "
        "columns written at its row offset",
        models=("tinylm",),
        data_modes=("replicated",),
        optimizers=("adamw",),
        features=("shard1",),
    ),
    # only a CPU offload policy (offload) keeps the shards in host memory; the fault acts on a CPU run too (the
    # host copy is stale whatever the device), from step 2's forward, and in the parameters reported at step 1
    Mutant(
        "offload_stale_host_copy",
        _spec("offload_stale_host_copy"),
        "ws1_exact",
        "under a CPU offload policy the all-gathers read a host copy of each shard made at wrapping, never "
        "updated by the optimizer",
        data_modes=("replicated",),
        optimizers=("adamw",),
        features=("offload",),
    ),
    Mutant(
        "optimizer_state_unsharded",
        _spec("optimizer_state_unsharded"),
        "memory_sharding",
        "optimizer state kept for the whole parameter on every rank (memory only)",
        data_modes=("replicated",),
        at_steps=None,
        kind="memory",
    ),  # memory does not depend on the mode
    Mutant(
        "meta_init_rng_order",
        _spec("meta_init_rng_order"),
        "ws1_exact",
        "meta-device init replays reset_parameters in another order than eager construction",
    ),
    Mutant(
        "per_sample_norms_allreduced",
        f"{MODULE}:per_sample_task",
        "per_sample_norms",
        "per-sample gradient norms all-reduced position by position instead of gathered by index",
        world_sizes=(2, 4),
        optimizers=(),
        at_steps=None,
        kind="per_sample",
    ),
    Mutant(
        "grads_not_cleared",
        _spec("grads_not_cleared"),
        "ws1_exact",
        "the unsharded gradient is never released: step k reduces the sum of steps 1..k",
        at_steps=(2, 2),
    ),
    Mutant(
        "stale_shard",
        _spec("stale_shard"),
        "cross_ws_replicated",
        "the last rank all-gathers a cached shard from before the optimizer step",
        world_sizes=(1, 2, 4),
        at_steps=(2, 2),
    ),
    Mutant(
        "tied_reduced_twice",
        _spec("tied_reduced_twice"),
        "ws1_exact",
        "a tied weight's gradient counted once per owner (doubled)",
        models=("tinylm_tied",),
        # AdamW only: under SGD at lr 1e-2 the reference tinylm_tied's loss rises over 3-5 steps,
        # so `converges` fails on the reference itself (not a cell that can judge a mutant)
        optimizers=("adamw",),
    ),
    Mutant(
        "frozen_updated",
        _spec("frozen_updated"),
        "split_matches_full_batch",
        "frozen parameters get gradients reduced and are stepped by the optimizer",
        models=("mlp_frozen",),
    ),
    Mutant(
        "bf16_reduce",
        _spec("bf16_reduce"),
        "ws1_exact",
        "gradients reduced in bf16 against the policy (fp32 params, fp64 reduce)",
        at_steps=(1, 2),
    ),
    Mutant(
        "param_left_out",
        _spec("param_left_out"),
        "params_cover_model",
        "full_params leaves out a parameter, so nothing about it is ever compared",
    ),
    Mutant(
        "unit_buffer_kept",
        _spec("unit_buffer_kept"),
        "memory_sharding",
        "each unit keeps a copy of its gathered parameters between steps (memory only)",
        data_modes=("replicated",),
        world_sizes=(2, 4),
        at_steps=None,
        kind="memory",
    ),
    Mutant(
        "optimizer_shadow_state",
        _spec("optimizer_shadow_state"),
        "memory_sharding",
        "the optimizer keeps full-size state outside optimizer.state (memory only)",
        data_modes=("replicated",),
        at_steps=None,
        kind="memory",
    ),
    Mutant(
        "prefetch_thread_gather",
        _spec("prefetch_thread_gather"),
        "comm_volume",
        "a prefetch thread all-gathers a unit it never uses (traffic only)",
        data_modes=("replicated",),
        world_sizes=(2, 4),
        at_steps=None,
        kind="traffic",
    ),
    # W = 8: W identical fp32 addends summed in order are exact up to 4 (partial sums 2g, 3g, 4g
    # round back), the first rounding is at 5g
    Mutant(
        "fp32_reduce",
        _spec("fp32_reduce"),
        "grads_match_ws1",
        "gradients summed in fp32 in rank order against the policy (fp64): an ulp off in places",
        data_modes=("replicated",),
        world_sizes=(1, 8),
    ),
    Mutant(
        "tie_broken",
        _spec("tie_broken"),
        "ws1_exact",
        "tied weights untied on wrapping: embedding and head train apart",
        models=("tinylm_tied",),
        optimizers=("adamw",),
    ),
    # two backward passes per step (accum): with one, writing over the gradient and adding to an
    # empty one are the same
    Mutant(
        "grad_overwritten",
        _spec("grad_overwritten"),
        "ws1_exact",
        "the reduced gradient written over the shard's .grad instead of added to it: under gradient "
        "accumulation only the last micro-batch counts",
        data_modes=("replicated",),
        features=("accum",),
    ),
    # the reduction switched off on all but the last micro-batch (no_sync); at W = 1 the reduction moves
    # nothing over the wire
    Mutant(
        "sync_ignored",
        _spec("sync_ignored"),
        "comm_volume",
        "the gradient-sync switch does nothing: every micro-batch is reduced (traffic only)",
        data_modes=("replicated",),
        world_sizes=(2, 4),
        at_steps=None,
        kind="traffic",
        features=("no_sync",),
    ),
    Mutant(
        "sync_never_restored",
        _spec("sync_never_restored"),
        "ws1_exact",
        "the gradient-sync switch is never turned back on: the accumulated gradient is never reduced",
        data_modes=("replicated",),
        features=("no_sync",),
    ),
    Mutant(
        "accum_averaged",
        _spec("accum_averaged"),
        "ws1_exact",
        "the gradient accumulated over unreduced micro-batches divided by their count although each "
        "micro-batch's loss is already scaled",
        data_modes=("replicated",),
        features=("no_sync",),
    ),
    Mutant(
        "clip_local_norm",
        _spec("clip_local_norm"),
        "clip_acts",
        "gradients clipped by the norm of the rank's own shard instead of the global norm",
        features=("clip", "clip_inf"),
        optimizers=("adamw",),
    ),
    Mutant(
        "held_in_param_dtype",
        _spec("held_in_param_dtype"),
        "ws1_exact",
        "under bf16 with the reduction switched off, the micro-batches' gradients summed in bf16, not fp32",
        features=("no_sync+bf16",),
        optimizers=("adamw",),
    ),
    Mutant(
        "clip_norm_reported_local",
        _spec("clip_norm_reported_local"),
        "ranks_agree",
        "clipping by the global norm, but ranks > 0 return their own shard's norm (rank 0 the global one)",
        features=("clip",),
        optimizers=("adamw",),
        at_steps=None,
        kind="report",
    ),
    Mutant(
        "bf16_optimizer_step",
        _spec("bf16_optimizer_step"),
        "ws1_exact",
        "under the bf16 policy the optimizer steps bf16 master parameters (each update rounded to bf16)",
        features=("bf16",),
        optimizers=("adamw",),
    ),
    # split data: one rank's gradient, or W equal ones, average to a bf16 value exactly. The first AdamW
    # update is lr x sign(g), which the rounding rarely changes: the parameters part at step 2 (SGD: 1).
    # On tinylm, where it moves the parameters 40x the bound by step 2; on the mlp only about 3x
    Mutant(
        "bf16_summed",
        _spec("bf16_summed"),
        "split_matches_full_batch",
        "under the bf16 policy the gradients are summed in bf16 (reduce_dtype ignored, as FSDP2 with "
        "reduce_dtype=None): each averaged element rounded to 8 significant bits",
        models=("tinylm",),
        data_modes=("split",),
        features=("bf16",),
        world_sizes=(1, 2, 4),
        at_steps=(1, 2),
    ),
    Mutant(
        "ac_reduced_twice",
        _spec("ac_reduced_twice"),
        "ws1_exact",
        "under activation checkpointing the post-backward reduction runs again after the recomputation",
        data_modes=("replicated",),
        features=("ac",),
        optimizers=("adamw",),
    ),
    # split data: with replicated data every replica's own mean is the global one
    Mutant(
        "replicas_not_averaged",
        _spec("replicas_not_averaged"),
        "split_matches_full_batch",
        "hybrid sharding whose replicas never average their gradients: each trains on its own samples",
        data_modes=("split",),
        features=("hsdp",),
        optimizers=("adamw",),
    ),
    # resumed after ckpt_step(3) = 1: the parameters right after loading are compared at step 1
    Mutant(
        "ckpt_last_rank_shifted",
        _spec("ckpt_last_rank_shifted"),
        "ckpt_restored",
        "a checkpoint reloaded with the last rank's part one element late (another layout's tail padding)",
        data_modes=("replicated",),
        features=("ckpt",),
        optimizers=("adamw",),
    ),
    # ckpt_restored holds the optimizer state every rank holds right after loading to what the saver's held
    Mutant(
        "ckpt_optimizer_state_shifted",
        _spec("ckpt_optimizer_state_shifted"),
        "ckpt_restored",
        "a checkpoint reloaded with the optimizer state one element off (cut at another layout's offsets)",
        data_modes=("replicated",),
        features=("ckpt",),
        optimizers=("adamw",),
    ),
    Mutant(
        "ckpt_step_restarted",
        _spec("ckpt_step_restarted"),
        "ckpt_restored",
        "a checkpoint reloaded with AdamW's step counter left at 0 (bias correction starts over; moments right)",
        data_modes=("replicated",),
        features=("ckpt",),
        optimizers=("adamw",),
    ),
    # A race, held by jitter_invariant to its calm twin (the same run without jitter, which runs beside it).
    # Not harmless without delays on this machine (2 cores shared by many processes): the calm twin, ranks
    # aligned at each step's start, read a gather before it arrived in 24 of 29 runs (mlp, W 2, 3 steps, load
    # 5-21). gloo's worker thread needs a core to finish the gather and gets one late while the reading thread
    # runs on: with one time.sleep(0) before the read, 48 of 48 prefetched gathers had arrived. So its plain
    # cell catches it here too. Under jitter every run broke (18 of 18) and jitter_invariant failed in each of
    # the 12 since it counts a NaN as a difference (both runs may go NaN alike: equal bits prove nothing there).
    # The first read of a prefetched gather is step 1's backward; the forward's, step 2.
    Mutant(
        "gather_read_early",
        _spec("gather_read_early"),
        "jitter_invariant",
        "a prefetched all-gather's output copied into the unsharded parameters before waiting for the gather",
        data_modes=("replicated",),
        optimizers=("adamw",),
        world_sizes=(2,),
        features=("jitter",),
        at_steps=(1, 3),
    ),
    # only a per-matrix optimizer shows it (AdamW and SGD step a shard as they step the matrix), and only at
    # W > 1 (at W = 1 the shard is the matrix): replicated data against W = 1 (held to the split tier, [Note:
    # user optimizer]), split data against the full batch
    Mutant(
        "shard_normalised",
        _spec("shard_normalised"),
        "cross_ws_replicated",
        "a per-matrix optimizer (normalised SGD) that normalises each rank's shard by its own norm instead of "
        "the whole matrix's (DeepSpeed #7807)",
        optimizers=(NORMALISED_SGD,),
    ),
    # Engines that drive their own step (DeepSpeed's kind), each with one fault modelled on a reported DeepSpeed bug
    # (suites/mutants/engine_mutants.py); the correct engine passes the same cells (suites/harness/end_to_end/
    # test_engines.py)
    Mutant(
        "engine_boundary_off_by_one",
        _spec("engine_boundary_off_by_one"),
        "ws1_exact",
        "an engine's accumulation boundary one micro-batch early: it steps after the first micro-batch and carries the "
        "last one's gradient into the next step (DeepSpeed #1488, #5898)",
        features=("accum",),
    ),
    Mutant(
        "engine_loss_scaled_twice",
        _spec("engine_loss_scaled_twice"),
        "ws1_exact",
        "an engine's loss divided by the accumulation twice (the engine's division and the loop's)",
        features=("accum",),
    ),
    Mutant(
        "engine_clip_by_partition",
        _spec("engine_clip_by_partition"),
        "cross_ws_replicated",
        "an engine that clips by the norm of its own partition of the gradient, not the global one",
        world_sizes=(1, 2),
        data_modes=("replicated",),
        features=("clip",),
        at_steps=(1, 2),  # AdamW's first step is lr x sign(g), which no clipping coefficient changes
    ),
    # ZeRO-1/2's reduce to each partition's owner with the owners one rank off (a stage-1 partition reduced to the
    # wrong rank); its correct counterpart is the control reduce_to_owners below
    Mutant(
        "reduced_to_wrong_owner",
        _spec("reduced_to_wrong_owner"),
        "cross_ws_replicated",
        "ZeRO-1/2's reduce to owners with each partition reduced on the next rank: every rank steps its rows with "
        "its neighbour's summed gradient",
        world_sizes=(1, 2, 4),
    ),
)

# Unmutated adapters run in the same matrix: the reference and these must pass every check.
CONTROLS: tuple[tuple[str, str], ...] = (
    ("fsdp_impl", "the product itself"),
    (_spec("meta_init"), "meta-device init by fsdp_impl.materialize_meta (control for meta_init_rng_order)"),
    (_spec("reduce_to_owners"), "gradients reduced by a reduce to each part's owner, ZeRO-1/2 style"),
    (_spec("gather_to_owners"), "gradients gathered on each part's owner and summed there"),
    (_spec("optimizer_delegated"), "an optimizer wrapper whose state the torch optimizer inside it holds"),
)
# Controls that only concern how gradients travel run in the plain model's cells up to 4 ranks,
# not in every cell a mutant runs in; the others run everywhere.
CONTROL_CELLS = {
    # meta-device builds equal the eager init only on models whose parameters are owned by leaves that
    # reset them (the zoo's property, harness/train/models.py), not on nn.MultiheadAttention or HF models
    _spec("meta_init"): lambda model, world_size: model in ZOO,
    _spec("reduce_to_owners"): lambda model, world_size: model == "mlp" and world_size <= 4,
    _spec("gather_to_owners"): lambda model, world_size: model == "mlp" and world_size <= 4,
    _spec("optimizer_delegated"): lambda model, world_size: model in ("mlp", "tinylm") and world_size <= 2,
}


def on_models(m: Mutant, models: tuple[str, ...]) -> Mutant:
    """`m` on `models` where it runs on the catalogue's default model (the mlp); a mutant whose own models
    expose it (a tied, frozen or transformer model), a per-sample one, and the meta-init ones (whose
    models must be meta-initializable: CONTROL_CELLS) keep theirs."""
    default = next(f.default for f in dataclasses.fields(Mutant) if f.name == "models")
    keeps = m.models != default or m.kind == "per_sample" or m.name.startswith("meta_init")
    return m if keeps else dataclasses.replace(m, models=tuple(models))


def by_name(name: str) -> Mutant:
    for m in CATALOGUE:
        if m.name == name:
            return m
    raise KeyError(f"no mutant {name!r}; known: {', '.join(m.name for m in CATALOGUE)}")
