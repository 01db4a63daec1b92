"""Numerics policy: the bounds each check holds, and the documented deviations of real implementations.

A deviation never widens a bound. When a listed implementation misses a bound under the listed
conditions, its verdict is KNOWN (shown with the measured value and the cause) instead of FAIL;
anywhere else the same miss is a FAIL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.core.scenario import has, parts, user_optimizer


@dataclass(frozen=True)
class Bounds:
    cross_ws_replicated: float = 3e-8  # max |param diff| vs world size 1, replicated data
    # split data: max |param diff| vs the full-batch reference, per unit of (lr x steps). Rounding of
    # the per-rank partial means differs from the full-batch mean at ~1e-7 relative; Adam's
    # normalisation can turn such a difference in a near-zero gradient into a full lr-sized step,
    # so the bound is stated relative to the largest total update lr x steps.
    split_per_lr_step_adamw: float = 1e-3
    split_per_lr_step_sgd: float = 1e-4
    # step-1 global gradient norm vs the non-sharded model, relative: rounding of the averaged
    # gradient only (measured <= 9e-9 on the default matrix; fp32 epsilon is 1.2e-7)
    grad_norm_rel: float = 1e-6
    # eval: where no bitwise tier applies (split data, L2 clipping), the eval loss vs the plain model's at the
    # run's own parameters, relative: the same function of the same parameters on the same samples, so rounding
    # at most ([Note: eval loss])
    eval_loss_rel: float = 1e-6
    # efficiency (checks/resources.py): relative slack on top of each figure's padding allowance
    memory_sharding_slack: float = 0.01  # per-rank state within 1% of (W=1 state) / W, plus padding
    peak_slack: float = 0.10  # peak within 10% of ideal state + two units unsharded + activations
    comm_slack: float = 0.01  # all-gathers <= 2P and the gradient reduction = trainable elements, +1%
    # flat-buffer alignment a shard may add per parameter tensor (a layout allowance, not a tolerance)
    align_bytes_per_tensor: int = 64
    # what a rank may hold outside parameters, gradients, optimizer state and the model's own buffers
    # between steps (harness.measure.census "other"): bookkeeping such as FSDP2's W int32 split sizes
    # (measured 4 B per rank of the group); a kept buffer of one unit's size is far above it
    held_elsewhere_bytes: int = 1024

    def split_bound(self, optimizer: str, lr: float, steps: int) -> float:
        """The split tier: AdamW's, or SGD's for SGD and for a user's optimizer ([Note: user optimizer])."""
        per = self.split_per_lr_step_adamw if optimizer == "adamw" else self.split_per_lr_step_sgd
        return per * lr * steps

    def reach(self, optimizer: str, lr: float, steps: int) -> float:
        """How far the optimizer can move an element whatever the gradient (adamw_reach), 0 where no such
        bound exists (SGD: its step is the gradient's size; a user's optimizer: its rule is not known, so its
        reach is measured per parameter instead, harness.checks.noise_floor.measured_reach)."""
        return adamw_reach(lr, steps) if optimizer == "adamw" else 0.0

    def replicated_bound(self, feature: str, optimizer: str, lr: float, steps: int) -> tuple[float, str]:
        """(bound, why) of cross_ws_replicated: 3e-8 where an exact reduction reproduces one rank's
        gradient; under L2 clipping or a user's optimizer the split tier's bound, for the cause in
        NOT_EXACT_UNDER_L2_CLIP or NOT_EXACT_USER_OPTIMIZER."""
        why = not_exact(feature, optimizer)
        if why:
            return self.split_bound(optimizer, lr, steps), f"the split tier's bound: {why}"
        return self.cross_ws_replicated, ""


# Why L2 clipping leaves no bitwise property across world sizes (cross_ws_replicated takes the split
# tier's bound, grads_match_ws1 does not apply): measured 1.19e-7 after 3 AdamW steps on tinylm_tied at
# W = 2 for both fsdp_impl and FSDP2, where every other feature is bitwise
# A parameter the model makes sensitive to that last bit (a bias before a BatchNorm, an attention key bias:
# seed 0 of the standard architectures, 1.35e-3 after 10 AdamW steps) is found by a noise probe with the
# coefficient nudged by W ulps (Scenario.nudge, [Note: noise floor]) and held to its floor or AdamW's reach.
NOT_EXACT_UNDER_L2_CLIP = (
    "under L2 clipping every gradient is scaled by the global norm, which W ranks sum from partial sums "
    "in another order than one rank does, so it differs in the last bit and AdamW amplifies that; no "
    "correct sharded clipping is bitwise across world sizes (clip_inf, a maximum, is); a parameter that "
    "the plain model with its clipping coefficient nudged by W ulps moves further is held to that floor")
# bf16 (harness.train.features.BF16_POLICY): how its runs are held.
# - World size 1 against the plain model under the same policy (bf16 copies of the parameters for forward
#   and backward, fp32 master parameters and optimizer): bitwise, as every feature (ws1_exact).
# - Replicated data against world size 1: bitwise too (cross_ws_replicated's 3e-8, grads_match_ws1), by
#   arithmetic, not by tuning: every gradient element arrives as a bf16 value (8 significant bits), and a
#   sum of W <= 8 such values needs at most 11, so the fp32 reduction is exact in any order and the mean
#   (a division by a power of two) too.
# - Split data at W ranks: each rank rounds the gradient of its own slice to bf16, and the reduction adds
#   those W bf16 values in fp32. The full batch's bf16 gradient is rounded once, from all samples, so it
#   is no yardstick: AdamW turns the 2^-8 rounding difference of a near-zero element into a full lr step
#   of the other sign (measured 0.01 = lr at step 1, mlp_frozen at W = 2, fsdp_impl and FSDP2 alike, and
#   a bound derived from the plain model's own bf16 drift was broken by correct runs). The yardstick is
#   the plain bf16 model stepping on the sum of the gradients of the same W micro-batches (rank r's slice
#   each, its loss scaled by 1 / W, a power of two: exact), harness.core.scenario.ROUNDED_PER_RANK. Its
#   micro-batch r runs the kernels rank r runs, on the same shapes and values, so it yields rank r's bf16
#   gradient / W bit for bit, and autograd adds the W of them in fp32 in rank order. A correct sharded run
#   then differs from it only in how those same fp32 addends are summed (order, or a wider accumulator),
#   at most a few fp32 roundings of the mean gradient: the rounding the split tier's bound already holds
#   in fp32 (split_per_lr_step_*), which applies unchanged. At W = 2 any order gives the same sum
#   (a + b is commutative and rounded once), so a correct run is bitwise; the tests hold that.
BF16_SPLIT = (
    "under bf16 each rank rounds its own gradient to bf16 before the fp32 reduction, so split data at W ranks "
    "is compared with the plain bf16 model summing the gradients of the same W micro-batches (rank r's slice "
    "each, loss scaled by 1/W): the same bf16 values, summed in fp32 in another order at most")

# [Note: noise floor] How split data is held on a model the bounds were not tuned on.
# The split tier's bound (split_per_lr_step_*) assumes every parameter's gradient stands well above its
# rounding noise. A parameter whose true gradient is zero breaks that: the key part of an attention input
# bias (softmax ignores a constant added to every key) gets a computed gradient that IS rounding noise
# (measured 7.7e-9 against 3.8e-2 for the query part), whose sign depends on how the batch's contributions
# are summed, and AdamW's first steps turn any such gradient into a step of about lr whatever its size:
# fsdp_impl, FSDP2 and an all-reduce adapter alike missed the bound by 140x on a 2-block
# nn.MultiheadAttention model. So the model's own sensitivity is measured, per parameter, and no tier widens:
# - The noise probe (harness.core.scenario.Scenario.noise_probes) is the plain model doing the run's step on
#   the same global batch cut into the slices the W ranks take, summed by autograd: a correct split
#   computation with no sharding code. Its max |param diff| from the full-batch reference over the run is
#   the parameter's floor f.
# - A correct sharded run computes each slice's gradient with the kernels the probe runs on the same slice
#   (bit for bit: the same shapes and values, as the bf16 micro-batch reference showed) and differs from
#   the probe only in the order in which it sums the W slice gradients. So |run - full| <= f + |run - probe|,
#   and the second term (the same addends in another order) is a smaller perturbation than the one f
#   measures (every addend computed from another batch shape than the full batch's): at most f again.
#   Hence NOISE_FLOOR_FACTOR = 2, and each parameter is held to max(tier bound, 2 f).
# - A healthy parameter's f is rounding carried through a few steps (2 f at most 5% of the tier bound on the
#   zoo's models: tinylm_tied, AdamW, W = 2, fsdp_impl and FSDP2 runs at W 1,2,4,8), so its bound is the
#   tier's, unchanged. A parameter whose 2 f exceeds the tier bound is model-sensitive:
#   its training is dominated by rounding on this model; the verdict and the report name it with its floor.
# - For a model-sensitive parameter "at most f again" is no bound: its trajectory is set by the signs of
#   rounding residues, and each correct run (each probe too) is one draw of it. Measured: correct runs of
#   fsdp_impl, FSDP2 and DDP on encoder_lm (accum and no_sync, W = 2, AdamW, seed 0) landed 1.04 x 2 f from
#   the full batch. Under AdamW the bound that holds for any two runs is the optimizer's reach: an element's
#   update m_hat / (sqrt(v_hat) + eps) never exceeds R_t = (1 - b1) / (1 - b1^t) x sqrt(1 - b2^t) /
#   sqrt(1 - b2) x sqrt((1 - c^t) / (1 - c)), c = b1^2 / b2 (Cauchy-Schwarz on m_t's sum against v_t's),
#   whatever the gradients (R_1 = 1; 1.04 at t = 10 for torch's betas), and decoupled weight decay only
#   shrinks a difference; so two runs from the same start part by at most 2 x lr x sum_t R_t
#   (adamw_reach). A model-sensitive parameter under AdamW is held to max(2 f, that reach): nothing beyond
#   "moved no further than AdamW can move anything" is a property of it, and the report says so. SGD has no
#   such reach (its step is the gradient's size): there 2 f stays its bound.
# - A model whose layers use batch statistics (BatchNorm without SyncBatchNorm) normalises each rank's slice
#   by that slice's statistics: split data is not the full batch's computation at all. The probe is then
#   the equivalent computation, and such a run is held to it with the tier bound (no floor applies).
NOISE_FLOOR_FACTOR = 2.0

# [Note: trajectory replayed] The floor is one draw, and a trajectory can leave it without any fault. Seed 3 of
# the standard architectures (AVX512): FSDP2 on encoder_lm, 8 ranks, split data, AdamW with accumulation, moved
# a few rows of layers.0.linear1.weight 8.7e-4 from the full batch's (tier 1e-4) at step 6, rank 5's rows only,
# while both probes stayed below half the tier (fsdp_impl and DDP: 2.4e-7). Simulated on AVX2 (encoder_lm,
# seed 5, the same cut): the rank-order, reversed, pass-major and ring orders of summing the same 16 slice
# gradients all moved one row of that weight 5.8e-4 from the full batch by step 10, a live unit whose
# gradient was ordinary at every step (1e-4 to 3e-3), 100x any other row: at step 7 that unit's ReLU input for
# one token was +4.1e-8 in the full batch's trajectory and -8.9e-8 in the rank order's (rounding-sized
# parameter differences, 1.5e-8, put it on either side of the kink), its gradient contribution appeared in
# one and not the other, and AdamW, which normalises each element's step, carried it on
# (reports/sweep/summation_orders.py, its output beside it). Which trajectory crosses
# such a kink is a draw no probe can make for another run. So a split run whose only failing verdict is that
# crossing, with every parameter within AdamW's reach (no bound is derived for SGD), is replayed up to the
# step of the crossing (harness.localize.replayed): the yardstick starts each step from the run's parameters
# and its optimizer steps on the run's gradients, and the localiser holds forward and backward bit for bit,
# the reduction within 2 (n - 1) u sum |g_i| (the rounding of summing the same terms in another order) and
# the optimizer's update bit for bit. A run that passes every step did, from where it stood, exactly what the
# plain model does: it is held to the reach and the verdict names the replay; any step that parts is the
# FAIL's cause, localised. Left out: runs resumed from a checkpoint (their optimizer state is the saver's),
# user optimizers (their update may reduce in the run's own order), torchrun jobs (no worlds to replay in).

BATCH_STATS_SPLIT = (
    "the model normalises with batch statistics ({layers}), so each rank normalises its own slice and split "
    "data is not the full batch's computation (it would be with SyncBatchNorm); it is held to the plain model "
    "stepping on the sum of the same per-rank micro-batches instead")


# [Note: rows at rounding level] rows_trained compares which rows of a parameter a run and its reference
# moved from their start. A row whose computed gradient is rounding noise (a bias before a BatchNorm, an
# attention key bias: their true gradient is zero) moves under SGD by lr x that noise, and whether that
# survives the rounding of the update depends on the last bits of everything before it: seed 1 of the
# standard architectures had a row of bn_mlp's first bias stay exactly in the plain model and move by one
# ulp (1.2e-10 at its value) in DDP and FSDP2 at 8 ranks with replicated data, whose reductions round
# otherwise (a documented deviation), and in runs resumed across world sizes. How far can rounding alone move
# an element? The noise in a computed gradient is a few ulps of the terms it sums, so lr x noise is about
# (lr x gradient term / parameter) ulps of the parameter: the relative size of a training step, below 1 for
# any stable run; each update then moves such an element by at most about one ulp of its parameter's scale,
# and `steps` updates by `steps` ulps. A row trained for real moves by that relative step size times the
# parameter (1e-3 to 1e-5 of it per step, ten thousand ulps and more). So a row is held as moved only beyond
# NOISE_FLOOR_FACTOR x steps ulps of its parameter's scale (the largest |value| of the parameter in either
# run, at the start or the end; `rounding_drift`), besides its noise floor where probes measured one. Left
# out: a parameter that is zero everywhere in both runs at both ends has no scale and is held bit for bit.
# The one-ulp argument fails where the noise is amplified: seed 4 had the same bias feed a BatchNorm over the
# two-sample slices of 8 ranks, whose tiny variance for a unit multiplies rounding, and runs resumed at 8 ranks
# from 2 or 4 (trajectories no probe follows) moved a row 30 and 120 ulps where the plain model left it
# exactly. There the model's own evidence decides: a row that a noise probe (a correct split computation)
# takes off its start at some step where the plain model never does, or the other way round, is one whose
# moving at all is rounding's, and it is not held (harness.tables.rows._probe_rows); a row that every
# correct computation leaves, or every one moves, is held as before.


def rounding_drift(scale: float, eps: float, steps: int) -> float:
    """How far rounding alone can move an element of a parameter whose largest |value| is `scale`, in a
    format whose machine epsilon is `eps`, over `steps` updates: NOISE_FLOOR_FACTOR x steps ulps of `scale`
    ([Note: rows at rounding level]); 0 for no scale."""
    if not (scale > 0 and math.isfinite(scale)) or steps <= 0:
        return 0.0
    return NOISE_FLOOR_FACTOR * steps * eps * 2.0 ** math.floor(math.log2(scale))


ADAMW_BETAS = (0.9, 0.999)  # harness.train.optim's AdamW (torch's defaults)


def adamw_reach(lr: float, steps: int, betas: tuple[float, float] = ADAMW_BETAS) -> float:
    """The most two AdamW runs from the same parameters can part by, per element, after `steps` steps,
    whatever their gradients: 2 x lr x sum of R_t ([Note: noise floor])."""
    b1, b2 = betas
    c = b1 * b1 / b2
    return 2 * lr * sum((1 - b1) / (1 - b1 ** t) * ((1 - b2 ** t) / (1 - b2)) ** 0.5 * ((1 - c ** t) / (1 - c)) ** 0.5
                        for t in range(1, steps + 1))


def model_sensitive(tier_bound: float, floor: float) -> bool:
    """A parameter whose NOISE_FLOOR_FACTOR x floor exceeds the tier's bound: rounding dominates its training."""
    return floor == floor and NOISE_FLOOR_FACTOR * floor > tier_bound


def noise_floor_bound(tier_bound: float, floor: float, reach: float = 0.0) -> float:
    """What one parameter is held to on split data ([Note: noise floor]): the tier's bound, or for a
    model-sensitive parameter NOISE_FLOOR_FACTOR x its measured noise floor, or the optimizer's `reach`
    (adamw_reach; 0 for an optimizer without one) where that is larger."""
    if not model_sensitive(tier_bound, floor):
        return tier_bound
    return max(NOISE_FLOOR_FACTOR * floor, reach)


# feature -> why no correct implementation is bitwise across world sizes under it
NOT_EXACT = {"clip": NOT_EXACT_UNDER_L2_CLIP}

# [Note: compositions] How features composed in one run ("hsdp+clip", harness.core.scenario.COMPOSE) are held.
# Each feature's rule says what it changes; a composition changes what each of its parts changes, so each
# bound is the rule of the part that changes that property most, never a sum or a new tolerance:
# - Yardstick: the plain model doing the same composition, less the parts that leave every number as the
#   plain step has it (NUMBERS_UNCHANGED: ac, ckpt, hsdp, jitter, reshard2, shard1), as for one feature: hsdp+clip against clip.
#   A timing-only part (jitter) is also left out of the world-size-1 run and the other factorisation, and the
#   run is held bitwise to the same composition without it (its calm twin, jitter_invariant).
# - Replicated data across world sizes: bitwise (3e-8, grads_match_ws1) unless a part is not exact
#   (not_exact: clip), then that part's rule (the split tier per parameter, with the nudged probe's floor).
# - Split data: against the full batch with the noise floors of every part's probes; if a part rounds per
#   rank (ROUNDED_PER_RANK: bf16), against the ranks' micro-batches as that part has it. Micro-batches of
#   accum or no_sync are cut inside each rank's slice, for the probes too.
# - A part that resumes (ckpt) resumes the rest of the composition: its saver runs the composition without
#   ckpt at the other world size, and a run resumed at another world size under a part that rounds per rank
#   is held where its first steps were trained (the saver's yardstick), or does not apply where no single
#   plain run trained both cuts (split_matches_full_batch).
# - Capabilities add up: an adapter runs a composition when it has every method each part needs
#   (harness.adapters.base.missing_capability), else the cell is unsupported and names the missing one.
# Pairs that cannot be composed are refused as a usage error (harness.core.scenario.EXCLUSIVE).


def not_exact(feature: str, optimizer: str = "adamw") -> str:
    """Why no correct implementation is bitwise across world sizes under this feature or composition and
    optimizer ('' where one is): a composition is not exact when one of its features is not ([Note:
    compositions]); a user's optimizer may reduce over the whole matrix ([Note: user optimizer])."""
    why = next((NOT_EXACT[f] for f in parts(feature) if f in NOT_EXACT), "")
    return why or (NOT_EXACT_USER_OPTIMIZER if user_optimizer(optimizer) else "")


# [Note: user optimizer] What a run with the user's optimizer (--optimizers package.module:factory) is held to.
# The harness does not know the optimizer's rule, so nothing is derived from it; every bound below is one
# that holds for adamw/sgd already, and none of theirs changes.
# - Yardstick: the plain model stepped by the same factory (the reference builds it over the plain model's
#   parameters, each adapter over the wrapped ones: make_optimizer(wrapped, name=..., lr=...)). So a
#   per-matrix optimizer is held to what it does on the whole matrix, at every world size.
# - World size 1: bitwise (ws1_exact), as for every optimizer: one rank's shard is the whole matrix.
# - Replicated data across world sizes: the update may depend on the whole matrix (a norm, as
#   harness.train.optim.NormalisedSGD takes), which on a sharded parameter W ranks sum from partial sums in
#   another order than one rank: the cause of L2 clipping's (NOT_EXACT_UNDER_L2_CLIP). So it is held as L2
#   clipping is, to the split tier's bound per parameter, and grads_match_ws1 (which reads the gradients
#   of steps after the first, computed at parameters that part by that rounding) does not apply. As under
#   clip, a nudged probe per world size measures which parameters that rounding moves (Scenario.is_nudged):
#   the plain model with every gradient the optimizer reads scaled by 1 + W fp32 ulps, which moves a
#   whole-matrix norm (and so the update) in its last bits as W partial sums may.
# - Split data: the strictest tier, SGD's (1e-4 x lr x steps), and the noise floors of the probes (the ranks'
#   micro-batches, and nudged ones), which run the same factory, so an optimizer that amplifies rounding (as
#   AdamW's normalisation does) shows it in its floors, measured on this model and optimizer.
# - A model-sensitive parameter (a bias before a BatchNorm: its gradient is rounding noise) is held, in both data
#   modes, to max(2 f, its measured reach). One correct run is one draw of a trajectory set by rounding
#   residues ([Note: noise floor]), and an optimizer that scales its step to a fixed size turns any noise into a
#   full step: normalised SGD moves every tensor by exactly lr a step, whatever the gradient, so after the first
#   step two correct runs of such a bias part by up to 2 x lr a step (measured on bn_mlp, seed 0, W = 2: 1.05e-2
#   after 3 steps, 2 f = 1.09e-2). No reach can be derived from an unknown rule, so it is measured: every run of
#   the plain model (the reference and its probes) records each step's ||step||_F per parameter (params table,
#   travel), and the reach is twice the furthest any of them travelled the parameter (the sum of its steps'
#   norms): two runs from the same start part by at most the sum of both runs' steps, element by element,
#   if a correct run's steps are no longer than the plain model's, as for any optimizer whose step size the
#   gradient's noise does not set (normalised SGD: 2 x lr x steps exactly). Measured over five seeds of the
#   standard architectures (W 1, 2, 4, both data modes, 10 steps, fsdp_impl, FSDP2, DDP): 0 false alarms, the
#   worst bn_mlp bias at 2.76e-2, beyond its 2 f of 2.56e-2 and at 14% of its reach. A healthy parameter is held to
#   the tier's bound, unchanged; a rounding-dominated one that a fault moves further than twice the plain
#   model's travel still fails.
# - Memory: the optimizer-state ideal is what the plain reference run of the same scenario holds, divided by
#   the shards (harness.checks.resources), not a guessed factor; traffic: one all-reduced element per
#   parameter tensor per step (a whole-matrix norm) is the optimizer's, not a gradient all-reduce.
# Measured: normalised SGD (harness.train.optim) on mlp after 3 steps at W = 2, replicated data, 1.49e-8 from
# W = 1 for fsdp_impl and FSDP2 (not bitwise: the norm's partial sums), 0 for DDP; a shard-normalised step
# (each shard by its own norm: mutant shard_normalised; FSDP1, whose optimizer sees flat-parameter views)
# is 2.5e-3 to 2.8e-3 off at step 1, about 900 x the bound (3e-6).
NOT_EXACT_USER_OPTIMIZER = (
    "a user's optimizer may compute its update from the whole matrix (a norm), which W ranks sum from partial "
    "sums in another order than one rank does, so it is held as L2 clipping is: to the split tier's bound")


# [Note: reshard2] How an integer reshard_after_forward (feature reshard2: after its forward each unit is resharded
# to groups of g = RESHARD_RANKS consecutive ranks, harness.core.scenario.post_forward_ranks) is held.
# - Numbers: it changes where a unit's rows wait between forward and backward and over which ranks backward
#   regathers them, not one value: the regathered parameter is the same rows, copied, not computed. So it is in
#   NUMBERS_UNCHANGED: the yardstick is the plain model's plain step, and every tier is the plain feature's
#   (bitwise at W = 1 and across world sizes with replicated data, the split tier with split data). At
#   W <= g it is the plain step (g = W reshards fully) and every check holds it as such.
# - Traffic (comm_volume, derived, not measured): forward gathers each unit over the shard group's S ranks (P
#   elements a pass, and P for an eval forward) and backward regathers it within its group of g ranks (P a
#   pass, over groups of g): the all-gathers over S ranks may hold no more than forward's P a pass. Totals
#   stay at the plain ideal (2P a pass). An implementation that reshards fully gathers 2P over S ranks and
#   fails there (mutant post_forward_full_reshard). The comm table records each collective's group size.
# - Memory (peak_memory_bound, peak_params_bound): between a unit's forward and its backward a rank holds
#   1 / g of it beside its own 1 / S shard (fsdp_impl and FSDP2 alike keep the post-forward block apart from
#   the sharded parameter); after the last forward every unit does at once, so both bounds add
#   param_bytes / g (and its padding) to what a plain step may hold. No unit is held in full after its forward:
#   units_gathered's allowances are the plain step's (an implementation that keeps them gathered fails
#   there: mutant post_forward_kept_gathered).
# - Compositions: reshard2 is a wrap of its own (wrap_reshard_after_forward), so it composes with every
#   feature that is not one (bf16, hsdp and shard1 are: harness.core.scenario.EXCLUSIVE).

# FSDP2 under reshard2 + eval: after the no_grad eval forward its units stay at the post-forward mesh (no
# backward comes to free it), so memory_sharding, measured after the step, finds param_bytes / g more
# parameters: a documented deviation (KNOWN_DEVIATIONS), named in the verdict as POST_FORWARD_AFTER_EVAL.
POST_FORWARD_AFTER_EVAL = "the post-forward shards kept after the eval forward"

# [Note: shard1] How a custom shard placement (feature shard1: Shard(1) wherever dim 1 divides evenly over the
# shard group, else Shard(0); harness.train.features.dim1_placement) is held.
# - Numbers: a placement decides which elements a rank keeps, not what is computed: the gathered parameter is
#   the same tensor, and each gradient element is the same W addends reduced in the same order whichever rank
#   owns it. So it is in NUMBERS_UNCHANGED: the plain reference and every tier of the plain step (bitwise at
#   W = 1 and across world sizes with replicated data, where the plain step is; FSDP2's fp32 ring at W >= 3
#   keeps its documented deviation, KNOWN_DEVIATIONS, whose cause does not depend on the placement).
# - Memory and traffic: even division (no padding) on the dim sharded, so the plain step's bounds hold
#   unchanged, their padding allowances an upper bound. A model with no parameter whose dim 1 divides (the
#   zoo's mlp) runs the plain step.
# - A layout fault is a numeric one (a column written at another rank's offset moves the loss at step 1:
#   mutant columns_as_rows, cross_ws_replicated). The localiser maps parameters held as dim-0 rows only: it
#   names a Shard(1) parameter as unmappable where it is first seen (the initial parameters).


# [Note: eval loss] How the eval feature's loss (a no_grad forward on a held-out batch after each optimizer
# step, harness.core.scenario FEATURES) is held: by the tier the same data mode holds the training to.
# - World size 1: bitwise the plain model's eval loss at every step, as ws1_exact holds the training loss.
# - Replicated data at W > 1 under an exact feature: bitwise the same implementation's at W = 1 (every rank
#   evaluates the same batch with parameters that cross_ws_replicated and grads_match_ws1 hold bitwise to
#   W = 1's); FSDP2 and DDP at 3 ranks and more miss it for the fp32 ring's cause (KNOWN_DEVIATIONS).
# - Split data (each rank evaluates its slice, the loss is the mean over the W ranks), or L2 clipping: the
#   parameters part from the yardstick's by rounding, which the parameter checks hold (with their noise floors).
#   The eval loss adds one question, whether the no_grad forward computes the model at the parameters the step
#   left, so it is held to the plain model's eval loss at the run's own snapshot of each step it trained, on the
#   held-out batch cut as the run cut it (eval_loss_plain, harness/train/plain_eval.py), within eval_loss_rel x
#   |that loss|. Holding it to the yardstick's eval loss instead, within twice the noise probes' spread, false-
#   alarmed: bn_mlp, SGD, W = 8, split data, seed 2 of the standard-architecture sweep, where BatchNorm over a
#   2-sample slice turns parameter differences of 7e-9 into eval losses 2.1e-6 apart, 3.4 times the one probe's
#   6e-7 (fsdp_impl; FSDP2 2.4e-6): one probe draws the rounding noise once, and of two independent Gaussian
#   draws one exceeds twice the other with probability 2/pi x atan(1/2), about 0.3. At the run's own parameters
#   fsdp_impl and FSDP2 evaluate bit for bit there.
# A forward under no_grad that computes with other parameters than the step left (stale, unsharded or
# padded ones) moves the eval loss far beyond these; resharding after it is held by units_gathered.

# Per-sample gradient norms (`--per-sample`), fp32 runs against a float64 truth
PER_SAMPLE_RTOL = 1e-5  # max |norm - truth| / truth per sample
CLIPPED_UPDATE_RTOL = 1e-5  # max |update - truth| / max |truth update| (SGD, lr 1)


@dataclass(frozen=True)
class KnownDeviation:
    impl: str
    check: str
    min_world_size: int
    cause: str
    feature: str | None = None  # only under this feature (harness.core.scenario.FEATURES)
    when: str = ""  # only when the verdict's message (a failed run's error) contains this text
    backend: str | None = None  # only on this backend (a property of its kernels, held exactly elsewhere)


_FSDP2_FP32_RING = (
    "FSDP2's default reduce-scatter sums fp32 gradients over a gloo ring: W identical fp32 addends "
    "summed one by one round at the partial sums 3g, 5g, 6g, 7g, so the averaged gradient differs from "
    "one rank's by ~1 ulp and AdamW amplifies that; torch_fsdp2_fp64reduce (reduce_dtype=float64) "
    "removes it")
_DDP_FP32_RING = (
    "DDP all-reduces fp32 gradient buckets over a gloo ring and divides by W: W identical fp32 addends "
    "summed one by one round at the partial sums 3g, 5g, 6g, 7g, as FSDP2's reduce-scatter does "
    "(measured at 8 ranks: 5.96e-08 on mlp after 7 AdamW steps, 1.19e-07 on tinylm after 10 SGD steps, "
    "the same figures as FSDP2)")

# The batch-invariant tier (harness/invariant): L, the global micro-batches an invariant step sums in its tree. A
# power of two (the tree is complete), at least the largest default world size (8: every rank takes L / W >= 1 of
# them), dividing the default global batch of 16 (2 samples each). Its bound is 0: nothing is derived because
# nothing may differ (bitwise at every W).
INVARIANT_MICRO_BATCHES = 8

# feature eval: what a check says when the only excess is the root's own parameters left gathered after the
# no_grad forward (harness/checks/resources.py units_gathered, memory_sharding); FSDP2 does that by design
ROOT_AFTER_EVAL = "the root's own parameters kept gathered after the eval forward"
_FSDP2_ROOT_AFTER_NO_GRAD = (
    "FSDP2 keeps the root module's parameters unsharded after its forward (fully_shard sets the root's "
    "reshard_after_forward to False unless it is passed explicitly: pytorch #155319), expecting the backward "
    "to follow; after a forward under torch.no_grad() none follows, so they stay gathered until the next "
    "training step's backward reshards them (pytorch #149029; model.reshard() or reshard_after_forward=True "
    "on the root frees them). fsdp_impl reshards every unit after a no_grad forward")

_DDP_BUCKET_VIEW_NORM_CUDA = (
    "DDP keeps each gradient as a view into its communication bucket (gradient_as_bucket_view, so that it holds "
    "no second copy), at offsets aligned to 4 bytes only; CUDA's norm kernels vectorise by the address's "
    "alignment, so the same gradient values reduce in another order than in the plain model's own allocations "
    "(measured on an H200, torch 2.11: torch.linalg.vector_norm and torch._foreach_norm of the same values "
    "differ by 1 ulp between a 16-byte-aligned and a 4-byte-aligned copy). The L2 clipping coefficient then "
    "differs by 1 to 2 ulps (the localiser: 'clipping (rounding only), the clipping coefficient applied') and "
    "AdamW carries it on (8.6e-6 on encoder_lm after 10 steps); on the CPU DDP is bitwise here")

KNOWN_DEVIATIONS = (
    KnownDeviation("ddp", "ws1_exact", 1, _DDP_BUCKET_VIEW_NORM_CUDA, feature="clip", backend="nccl"),
    KnownDeviation("torch_fsdp2", "cross_ws_replicated", 3, _FSDP2_FP32_RING),
    KnownDeviation("ddp", "cross_ws_replicated", 3, _DDP_FP32_RING),
    # the same rounding, seen directly in the reduced gradient (its first ulp, at step 1)
    KnownDeviation("torch_fsdp2", "grads_match_ws1", 3, _FSDP2_FP32_RING),
    KnownDeviation("ddp", "grads_match_ws1", 3, _DDP_FP32_RING),
    # the eval loss of those parameters (feature eval, replicated data: bitwise W = 1's elsewhere)
    KnownDeviation("torch_fsdp2", "eval_matches", 3, _FSDP2_FP32_RING),
    KnownDeviation("ddp", "eval_matches", 3, _DDP_FP32_RING),
    KnownDeviation("torch_fsdp2", "units_gathered", 2, _FSDP2_ROOT_AFTER_NO_GRAD, feature="eval",
                   when=ROOT_AFTER_EVAL),
    KnownDeviation("torch_fsdp2", "memory_sharding", 1, _FSDP2_ROOT_AFTER_NO_GRAD, feature="eval",
                   when=ROOT_AFTER_EVAL),
    # the same parameters under a CPU offload policy: the gathered copy is on the device (measured on an H200)
    KnownDeviation("torch_fsdp2", "offload_host", 1, _FSDP2_ROOT_AFTER_NO_GRAD, feature="eval",
                   when=ROOT_AFTER_EVAL),
    KnownDeviation(
        "torch_fsdp2", "memory_sharding", 4,
        "FSDP2 with an integer reshard_after_forward reshards each unit to the smaller post-forward mesh after "
        "every forward, a no_grad one included, and frees it only in the backward that never follows an eval "
        "forward: param_bytes / g stay held until the next training step (reshard() frees them). fsdp_impl "
        "reshards fully after a no_grad forward", feature="reshard2", when=POST_FORWARD_AFTER_EVAL),
    KnownDeviation(
        "torch_fsdp1", "memory_sharding", 2,
        "FSDP1 (FULL_SHARD) never frees the root's unsharded flat parameter in its post-forward (_post_forward_reshard: "
        "'with the intention that they are immediately used for backward computation (though this may not be "
        "true)'); it points the parameters back at their shards, so the unit timeline sees none gathered, but "
        "after a forward under torch.no_grad() the full buffer stays allocated until the next step's backward, "
        "counted outside the parameters", feature="eval", when=ROOT_AFTER_EVAL),
    KnownDeviation(
        "torch_fsdp2", "peak_params_bound", 2,
        "FSDP2 on gloo now and then holds one more gathered unit at the step's peak than the bound's two "
        "(measured once in seven full CPU runs: torch_fsdp2-tinylm-ws4-replicated-adamw, 188,064 B against "
        "142,564 B, one tinylm block's gathered parameters over; every other run passed). The likely cause is "
        "the race documented for the peak_mem gate: gloo's worker thread drops its reference to a collective's "
        "output only after wait() returns, so an all-gather buffer FSDP2 has already released may still be "
        "alive at the peak. Not seen on fsdp_impl, whose reshard frees its own buffer",
    ),
    KnownDeviation(
        "torch_fsdp2", "completed", 2,
        "torch.nn.utils.clip_grad_norm_ with norm_type=inf raises on FSDP2's DTensor gradients when a rank's "
        "Shard(0) of some parameter is empty (dim 0 below the world size: the mlp's 7-row layer at 8 ranks, "
        "the example model's 5-row head at 4): torch._foreach_norm refuses an infinity norm of an empty tensor "
        "(max has no identity). The run stops there; fsdp_impl.clip_grad_norm_ handles empty parts",
        feature="clip_inf", when="_foreach_norm cannot compute the infinity norm on an empty tensor",
    ),
)


# Per-sample gradient norms (`--per-sample`): Opacus as measured, not our code.
OPACUS_EMPTY_SHARD = KnownDeviation(
    "opacus", "per_sample_norms", 2,
    "Opacus ghost_fsdp (make_private + one SGD step) raises when FSDP2's Shard(0) leaves some rank an "
    "empty shard of a parameter whose dim 0 is below the world size (DTensor refuses the in-place "
    "aten.add_ that would change placements); nothing is measured for it",
)


def known_deviation(impl: str, check: str, world_size: int, feature: str = "plain",
                    message: str = "", backend: str = "gloo") -> KnownDeviation | None:
    for dev in KNOWN_DEVIATIONS:
        if (dev.impl == impl and dev.check == check and world_size >= dev.min_world_size
                and (dev.feature is None or has(feature, dev.feature)) and dev.when in message
                and dev.backend in (None, backend)):
            return dev
    return None
