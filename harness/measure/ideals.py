"""The ZeRO-3 ideals the measured figures are held to: plain arithmetic on sizes, free of torch, so the
process that judges a run (the parent, or a pytest controller) does not import what only ranks need."""

from __future__ import annotations

import math


def ideal_comm_elements(param_elements: int, world_size: int, trainable_elements: int | None = None) -> dict[str, int]:
    """ZeRO-3 ideal per step, in elements of the full size each collective handles (as `CommCounter`
    counts them): all_gather 2P (forward, and the re-gather for backward), gradient reduction T, the
    trainable elements (P when nothing is frozen: a frozen parameter is gathered, never reduced);
    {} at W == 1, where nothing needs to move.

    Measured runs differ from it by rule, not by accident: parameters are padded to equal shards
    (FSDP2 pads each parameter's dim 0 to a multiple of W; flat-buffer implementations pad the
    buffer), and a unit that is not resharded after forward is gathered once, not twice: FSDP2's
    root unit and an FSDP1 root-only wrap, so all_gather = 2P - (root unit's elements) there."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return {}
    reduced = param_elements if trainable_elements is None else trainable_elements
    return {"all_gather": 2 * param_elements, "reduce_scatter": reduced}


STATE = ("params", "grads", "optimizer_state")  # the training state ZeRO partitions, stage 3 all of it


# Optimizer name -> state bytes per parameter byte (steps counters, a few bytes each, left out).
OPTIMIZER_STATE_FACTOR = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_momentum": 1, "sgd_nomomentum": 0}


def ideal_state_bytes(
    full_param_bytes: int,
    optimizer: str,
    world_size: int,
    *,
    sharded: bool = True,
    state_factor: float | None = None,
    partitioned: tuple[str, ...] | None = None,
) -> dict[str, int]:
    """Per-rank ZeRO-3 ideal: params, grads and optimizer state of P bytes each divided by W
    (ceil, padding ignored); ``sharded=False`` (DDP) keeps the full size on every rank. `partitioned`: the
    categories the implementation divides (STATE when None and sharded: ZeRO-3; ZeRO-1 divides the optimizer
    state alone, ZeRO-2 the gradients too), the others kept whole on every rank.
    Optimizer state is 2P for adam/adamw (exp_avg, exp_avg_sq), P for sgd with momentum, or
    `state_factor` x P where the caller measured it (a user's optimizer, whose rule is not known here:
    harness.checks.resources reads it off the plain reference run)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if state_factor is None:
        try:
            state_factor = OPTIMIZER_STATE_FACTOR[optimizer.lower()]
        except KeyError:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE_FACTOR)} "
                f"(a user's optimizer needs its measured state_factor)"
            ) from None
    partitioned = (STATE if sharded else ()) if partitioned is None else partitioned
    per = {cat: -(-full_param_bytes // (world_size if cat in partitioned else 1)) for cat in STATE}
    return {
        "params": per["params"],
        "grads": per["grads"],
        "optimizer_state": math.ceil(state_factor * per["optimizer_state"]),
    }
