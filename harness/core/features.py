"""The feature registry: what one training step does besides forward, backward and the optimizer step.

Each feature is one `Feature` object: what its step does, what it exposes, what it needs of an adapter (a method,
or a setting of the one composable wrap, harness.adapters.base.WrapOptions), and the properties the matrix and
the checks read (how many passes and reductions a step makes, whether it must leave every number as the plain
step has it, ...). The CLI's help, the capability checks (harness.adapters.base.missing_capability) and the
summary table of docs/features.md (`docs_table`) are made from it; docs/features.md says per feature what the
harness holds it to.

Features compose: ``hsdp+clip`` acts as both in one run, its parts in registry order whatever order they are
written in. Two features of one scheme cannot (two micro-batch schemes, two clipping norms); any two wrap
settings can, where the implementation itself takes them together (the adapter says which it takes, and why
not where it refuses a pair).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPOSE = "+"
ACCUM_MICRO_BATCHES = 2  # accum, no_sync: the rank's batch in this many micro-batches
HSDP_REPLICAS = 2  # replicas of a hybrid mesh at W >= 2 (2 x 1 at W = 2, 2 x 2 at 4, 2 x 4 at 8)
RESHARD_RANKS = 2  # reshard2: the ranks of the group each unit is resharded to after forward

# The settings of the one composable wrap (harness.adapters.base.WrapOptions), and the method of the deprecated
# protocol that took each alone.
WRAP_SETTINGS = {
    "mixed_precision": "wrap_mixed_precision",
    "hybrid": "wrap_hybrid",
    "reshard_after_forward": "wrap_reshard_after_forward",
    "shard_placement": "wrap_shard_placement",
    "offload": "wrap_offload",
}
# What an implementation that drives the step itself (an engine: the adapter's engine hooks) must declare it does,
# in place of the methods the harness would call: the micro-batch accumulation and the clipping of its step.
ENGINE_SETTINGS = ("accumulation", "clipping")


@dataclass(frozen=True)
class Feature:
    name: str
    step: str  # what one step does, in a line (CLI help, the docs' table)
    exposes: str = ""  # what a faulty implementation shows under it, in a line (the docs' table)
    needs: tuple[str, ...] = ()  # adapter methods beyond the protocol's required ones
    wrap: str | None = None  # the wrap setting it sets (WRAP_SETTINGS)
    engine: str | None = None  # what an engine declares for it in place of `needs` (ENGINE_SETTINGS)
    passes: int = 1  # forward and backward passes per step: each gathers the parameters
    reductions: int = 1  # gradient reductions per step
    scheme: str | None = None  # at most one feature of a scheme per composition (the scheme in the plural)
    clip: tuple[float, float] | None = None  # (norm type, max norm)
    # must leave every number as the plain step has it: compared with the plain reference
    numbers_unchanged: bool = False
    # only changes when things happen, never what is computed: the runs a run is compared with leave it out,
    # and each run is held bitwise to its own calm twin (Scenario.calm)
    timing_only: bool = False
    # every rank rounds its own gradient before the reduction sums it (bf16): a split run is compared with the
    # plain model accumulating the same W micro-batches (Scenario.micro_batches; policy BF16_SPLIT)
    rounded_per_rank: bool = False
    # the sharded step computes a scalar of the whole gradient from W partial sums (the L2 clipping norm): its
    # noise probes include a nudged one (Scenario.nudge)
    nudged: bool = False

    @property
    def capability(self) -> str:
        """What an adapter needs for it, as the docs' table says it."""
        wrap = [f"wrap setting `{self.wrap}`"] if self.wrap else []
        engine = [f"(an engine: `{self.engine}`)"] if self.engine else []
        return " ".join([", ".join([f"`{m}`" for m in self.needs] + wrap)] + engine).strip()


REGISTRY: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("plain", "one forward and backward on the rank's batch"),
        Feature(
            "accum",
            f"{ACCUM_MICRO_BATCHES} micro-batches, a backward each, one optimizer step",
            "a reduced gradient written over `.grad`",
            engine="accumulation",
            passes=ACCUM_MICRO_BATCHES,
            reductions=ACCUM_MICRO_BATCHES,
            scheme="micro-batch schemes",
        ),
        Feature(
            "no_sync",
            "the same, reduction off on all but the last",
            "a switch that does nothing, or is never turned back on",
            needs=("set_gradient_sync",),
            passes=ACCUM_MICRO_BATCHES,
            scheme="micro-batch schemes",
        ),
        Feature(
            "clip",
            "gradients clipped to a global L2 norm of 0.1",
            "a norm over the rank's own shard",
            needs=("clip_grad_norm",),
            engine="clipping",
            scheme="clipping norms",
            clip=(2.0, 0.1),
            nudged=True,
        ),
        Feature(
            "clip_inf",
            "the same with the infinity norm, max 0.01",
            "the same, exactly at any world size",
            needs=("clip_grad_norm",),
            engine="clipping",
            scheme="clipping norms",
            clip=(float("inf"), 0.01),
        ),
        Feature(
            "ac", "activation checkpointing on every unit", "a number the recomputation changes", numbers_unchanged=True
        ),
        Feature(
            "ckpt",
            "resumed from a checkpoint saved at another world size",
            "state restored wrong",
            needs=("save_checkpoint", "load_checkpoint"),
            numbers_unchanged=True,
        ),
        Feature(
            "bf16",
            "bf16 compute, fp32 master weights and reduction",
            "a reduction or optimizer step in bf16",
            wrap="mixed_precision",
            rounded_per_rank=True,
        ),
        Feature(
            "hsdp",
            f"{HSDP_REPLICAS} replicas of W/{HSDP_REPLICAS} ranks each",
            "replicas that never average",
            wrap="hybrid",
            numbers_unchanged=True,
        ),
        Feature("eval", "a no_grad forward on a held-out batch after each step", "a unit left gathered after it"),
        Feature(
            "jitter",
            "seeded delays before collectives and waits",
            "a read of an asynchronous result before its wait",
            numbers_unchanged=True,
            timing_only=True,
        ),
        Feature(
            "reshard2",
            f"an integer `reshard_after_forward` (groups of {RESHARD_RANKS})",
            "a full reshard, or none, after forward",
            wrap="reshard_after_forward",
            numbers_unchanged=True,
        ),
        Feature(
            "shard1",
            "Shard(1) wherever dim 1 divides evenly",
            "a chunk copied to the wrong place",
            wrap="shard_placement",
            numbers_unchanged=True,
        ),
        Feature(
            "offload",
            "parameters, gradients and optimizer state on the host",
            "a stale host copy; state left on the device",
            wrap="offload",
        ),
    )
}
FEATURES = tuple(REGISTRY)  # the names, in the order a composition's parts are written


def named(prop: str) -> tuple[str, ...]:
    """The features for which `prop` (a Feature field) is set."""
    return tuple(f.name for f in REGISTRY.values() if getattr(f, prop))


# Compositions #


def parts(feature: str) -> tuple[str, ...]:
    """The features a (composed) feature is made of, in registry order; () for plain."""
    names = feature.split(COMPOSE)
    return tuple(f for f in FEATURES if f != "plain" and f in names)


def has(feature: str, name: str) -> bool:
    """Whether a (composed) feature includes `name`."""
    return name in feature.split(COMPOSE)


def compose(names) -> str:
    """The canonical name of these features together ('plain' for none)."""
    names = set(names)
    return COMPOSE.join(f for f in FEATURES if f != "plain" and f in names) or "plain"


def without(feature: str, *names: str) -> str:
    """The composition less `names` ('plain' when nothing is left)."""
    return compose(f for f in parts(feature) if f not in names)


def check_feature(text: str) -> str:
    """`text` (a feature, or features joined by '+') as its canonical name; ValueError (one line) if a part is
    unknown, repeated, or of the same scheme as another."""
    names = [t.strip() for t in text.split(COMPOSE)]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        where = f" in {text!r}" if len(names) > 1 else ""
        raise ValueError(
            f"unknown feature {unknown[0]!r}{where}; choose from {', '.join(FEATURES)} "
            f"(compose them with {COMPOSE!r}, e.g. hsdp{COMPOSE}clip)"
        )
    if len(set(names)) < len(names):
        raise ValueError(f"{text!r} names a feature twice")
    if "plain" in names and len(names) > 1:
        raise ValueError(f"{text!r}: plain is the step without features; it composes with nothing")
    for scheme in {REGISTRY[n].scheme for n in names} - {None}:
        mine = [n for n in FEATURES if n in names and REGISTRY[n].scheme == scheme]
        if len(mine) > 1:
            raise ValueError(f"{COMPOSE.join(mine)} cannot be composed: two {scheme}")
    return compose(names)


def conflicting_pairs() -> list[tuple[str, str]]:
    """Every pair of features that cannot compose (of one scheme)."""
    return [
        (a, b)
        for i, a in enumerate(FEATURES)
        for b in FEATURES[i + 1 :]
        if REGISTRY[a].scheme is not None and REGISTRY[a].scheme == REGISTRY[b].scheme
    ]


def wrap_settings(feature: str) -> tuple[str, ...]:
    """The wrap settings a composition sets (WRAP_SETTINGS), in registry order."""
    return tuple(REGISTRY[f].wrap for f in parts(feature) if REGISTRY[f].wrap)


# What a composition's step does #


def clip_of(feature: str) -> tuple[float, float] | None:
    """(norm type, max norm) of the composition's clipping part, None without one."""
    return next((REGISTRY[f].clip for f in parts(feature) if REGISTRY[f].clip), None)


def rounded_per_rank(feature: str) -> bool:
    """Whether the composition rounds each rank's gradient before the reduction."""
    return any(REGISTRY[f].rounded_per_rank for f in parts(feature))


def nudged(feature: str) -> bool:
    """Whether the composition's sharded step computes a scalar of the whole gradient from partial sums."""
    return any(REGISTRY[f].nudged for f in parts(feature))


def passes_per_step(feature: str) -> int:
    """Forward and backward passes in one training step: each gathers the parameters."""
    return max((REGISTRY[f].passes for f in parts(feature)), default=1)


def reductions_per_step(feature: str) -> int:
    """Gradient reductions in one training step."""
    return max((REGISTRY[f].reductions for f in parts(feature)), default=1)


def holds_unsharded_grads(feature: str) -> bool:
    """Whether the step keeps every unit's unsharded gradient between passes (no reduction until the last)."""
    return reductions_per_step(feature) < passes_per_step(feature)


def hsdp_mesh(world_size: int) -> tuple[int, int]:
    """(replicas, shard size) of the hybrid mesh at `world_size`; rank = replica x shard size + shard index."""
    replicas = HSDP_REPLICAS if world_size % HSDP_REPLICAS == 0 else 1
    return replicas, world_size // replicas


def shard_size(feature: str, world_size: int) -> int:
    """Ranks one parameter is sharded over: all of them, or one replica's under hybrid sharding."""
    return hsdp_mesh(world_size)[1] if has(feature, "hsdp") else world_size


def post_forward_ranks(feature: str, world_size: int) -> int:
    """Ranks a unit is spread over between its forward and its backward: RESHARD_RANKS under reshard2 (the
    integer reshard_after_forward an adapter is handed; all W ranks where W <= RESHARD_RANKS: then it is
    the plain step), else every rank of the shard group."""
    shard = shard_size(feature, world_size)
    return min(RESHARD_RANKS, shard) if has(feature, "reshard2") else shard


# The docs' table #


def docs_table() -> str:
    """docs/features.md's summary table (markdown), made from the registry."""
    rows = ["| feature | one step | adapter capability | what it exposes |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.step} | {f.capability} | {f.exposes} |" for f in REGISTRY.values()]
    return "\n".join(rows)
