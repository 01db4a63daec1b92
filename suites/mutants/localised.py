"""Where each numeric mutant's defect is: the phase and the module the localiser (harness.localize) must name
for it, in its cell (`cell`), or why it cannot.

Kept beside the catalogue (suites/mutants/catalog.py), by mutant name; suites/mutants/test_localize.py holds
every numeric mutant to be in exactly one of WHERE and NOT_LOCALISED.
"""

from __future__ import annotations

from harness.core.scenario import Scenario
from suites.mutants.catalog import Mutant

REDUCTION, FORWARD, INITIAL = "gradient reduction", "forward", "initial parameters"

# name -> (phase, module): the mlp's units are layers.0-2; tinylm_tied's embedding is the root's own
WHERE = {
    "grad_summed": (REDUCTION, "layers.0"),  # division by W missing in the reduction
    "last_rank_negated": (REDUCTION, "layers.0"),
    "last_rank_scaled_input": (REDUCTION, "layers.0"),  # named with "rank r put a different gradient into ..."
    "averaged_twice": (REDUCTION, "layers.0"),
    "wrong_shard_offset": (INITIAL, "layers.0"),  # the shards hold the wrong rows from the start
    "padding_not_zeroed": (REDUCTION, "layers.0"),  # the padding rows of the reduced shard
    "padding_in_view": (FORWARD, "layers.0"),  # the first op computing with the misread parameter
    "meta_init_rng_order": (INITIAL, "layers.0"),
    "grads_not_cleared": (REDUCTION, "layers.0"),  # step 2 reduces the sum of steps 1 and 2
    "stale_shard": (FORWARD, "layers.0"),  # step 2's forward computes with the cached shard
    "tied_reduced_twice": (REDUCTION, "(root)"),
    "frozen_updated": ("optimizer step", "layers.0"),
    "bf16_reduce": (REDUCTION, "layers.0"),
    "fp32_reduce": (REDUCTION, "layers.0"),  # an ulp off: named as rounding at the reduction
    # the embedding's gradient lacks the head's part: the yardstick's backward sums the head's part into the tied
    # weight's gradient (an add under the embedding's node), which the untied rank never runs
    "tie_broken": ("backward", "embed"),
    "grad_overwritten": (REDUCTION, "layers.0"),
    "sync_never_restored": (REDUCTION, "layers.0"),  # no gradient after the backward
    "accum_averaged": (REDUCTION, "layers.0"),
    "clip_local_norm": ("clipping", "layers.0"),
    "held_in_param_dtype": (REDUCTION, "layers.0"),
    "bf16_optimizer_step": ("optimizer step", "layers.0"),
    "bf16_summed": (REDUCTION, "embed"),
    "ac_reduced_twice": (REDUCTION, "layers.0"),
    "replicas_not_averaged": (REDUCTION, "layers.0"),
    "ckpt_last_rank_shifted": ("checkpoint load", "layers.0"),
    "ckpt_optimizer_state_shifted": ("optimizer step", "layers.0"),  # the state loaded shifted: the update
    "tail_before_last_dropped": (REDUCTION, "(root)"),  # rank 6's short chunk of the tied embedding's gradient
    "ckpt_step_restarted": ("optimizer step", "layers.0"),  # the step counter loaded as 0: the update
    # a race: where it shows depends on which gather a late rank leaves half-read; in the replays tried (4 of 4)
    # step 2's first forward prefetch, the root's of layers.0, read before the rank whose part was late sent it
    "gather_read_early": (FORWARD, "layers.0"),
    "shard_normalised": ("optimizer step", "layers.0"),  # each shard divided by its own norm
    # the localiser maps parameters held whole or as dim-0 rows only: in a shard1 run it names the first
    # parameter held as dim-1 columns (tinylm's embedding, the root's first unit) as unmappable at the initial
    # parameters, where that layout is first seen, not the copy-out that misplaces its columns
    "columns_as_rows": (INITIAL, "embed"),
    "offload_stale_host_copy": (FORWARD, "layers.0"),  # step 2's forward gathers the initial shards
    # engines: the loop's extra division is the loss's backward (outside any module); the early step changes the
    # parameters the next micro-batch's forward computes with; the partition's norm scales every gradient wrongly
    "engine_loss_scaled_twice": ("backward", "(outside modules)"),
    "engine_boundary_off_by_one": (FORWARD, "layers.0"),
    "engine_clip_by_partition": ("clipping", "layers.0"),
    "reduced_to_wrong_owner": (REDUCTION, "layers.0"),  # the reduced shard holds another rank's rows
}
# name -> why the localiser names nothing for it
NOT_LOCALISED = {
    "param_left_out": "the training is right on every rank; the adapter's full_params leaves a parameter out of "
    "its report, which the localiser does not read (params_cover_model catches it)",
}
# faults whose defect is rounding-sized: named as the reduction's rounding (Point.rounding), not beyond it
ROUNDING = {"fp32_reduce"}


# per-sample mutants (kind "per_sample"): where harness.localize.per_sample must put them, in PER_SAMPLE_CELL
PER_SAMPLE_WHERE = {"per_sample_norms_allreduced": ("exchange", "all_reduce")}  # the norms were right when sent
PER_SAMPLE_CELL = {"model": "mlp", "world_size": 2, "mode": "split", "batch": 16, "step": 1}


def localise_per_sample(m: Mutant, pool, seed: int = 0):
    """A per-sample mutant's norms traced in its cell and localised (harness.localize.per_sample)."""
    from harness.localize.per_sample import replay
    from harness.per_sample.tasks import truth

    c = PER_SAMPLE_CELL
    payload = {"model": c["model"], "seed": seed, "batch": c["batch"], "step": c["step"], "mode": c["mode"]}
    return replay(
        pool, c["world_size"], m.spec, payload, "mutant", truth(c["model"], seed, c["batch"], c["step"]).norms
    )


def cell(m: Mutant) -> Scenario:
    """The scenario a mutant is localised in: its widest world size, replicated data where it has it, its
    first optimizer and feature; a ckpt mutant resumes at 2 ranks from 1."""
    ws = max(m.world_sizes)
    mode = "replicated" if "replicated" in m.data_modes else "split"
    feature = m.features[0]
    resume = (1 if ws == 2 else 2) if "ckpt" in feature.split("+") else 0
    return Scenario(m.spec, m.models[0], ws, mode, m.optimizers[0], steps=m.steps, feature=feature, resume_from=resume)
