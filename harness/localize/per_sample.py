"""Where a per-sample gradient norm check parted from the truth: a rank's own computation, or the exchange.

Per-sample norms (DP-SGD) are computed by each rank for its own samples, then exchanged so that every rank
holds them in global sample order. The truth is the plain model in float64 (harness.per_sample.tasks), not
an op sequence a rank runs, so the op-by-op replay of training does not apply. What can be told from
outside, through torch alone, is which side of the exchange the fault is on: the task runs again with
every collective's arguments recorded as the rank gave them (a dispatch mode, values read before the
collective runs), and for each rank the harness looks for its own samples' truth norms, or their squares
(what a reduction of partial norms would send), among what it sent, to the check's bound.

- Found on every rank: each rank's norms were right when they went into that collective; the global
  norms after the exchange are not, so the exchange placed or combined them wrongly: the chain names the
  collective (its index among the rank's collectives and its kind) and the first wrong sample.
- Not found on some rank: none of what that rank sent holds its own samples' norms; the chain says so
  (its computation, or an encoding of the norms this search does not read), and names no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.core.policy import PER_SAMPLE_RTOL
from harness.measure.comm import classify, tensors_of

MAX_RECORDED = 1 << 14  # elements of one argument kept: per-sample norms are one per sample
TRACED_TASK = "harness.localize.per_sample:traced_task"


class SentRecorder(TorchDispatchMode):
    """Every collective's floating tensor arguments, as values before it runs: [(kind, [values, ...])]."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[str, list[list[float]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = classify(func, tuple(args))
        if found is not None:
            values = [
                t.detach().reshape(-1).to("cpu", torch.float64).tolist()
                for a in args
                for t in tensors_of(a)
                if t.is_floating_point() and 0 < t.numel() <= MAX_RECORDED
            ]
            self.sent.append((f"{found[0]} ({func._overloadpacket.__name__})", values))
        return func(*args, **kwargs)


def traced_task(ctx, payload: dict) -> dict:
    """World task: runs `payload["task"]` ("module:function") on `payload["payload"]` with the recorder on."""
    from harness.execute.worker import resolve

    fn = resolve(payload["task"])
    with SentRecorder() as rec:
        result = fn(ctx, payload["payload"])
    return {"result": result, "sent": rec.sent}


@dataclass
class PerSampleLocalised:
    where: str  # "exchange" | "computation" | "nothing"
    rank: int | None
    collective: str | None  # "#k <kind>" on that rank
    lines: list[str]

    def short(self) -> str:
        return " -> ".join(self.lines)


def _matches(values: list[float], own: torch.Tensor, bound: float) -> bool:
    v = torch.tensor(values, dtype=torch.float64)
    if v.shape != own.shape:
        return False
    for target in (own, own.pow(2)):
        if bool((((v - target).abs() / target.abs()).nan_to_num(float("inf")) < bound).all()):
            return True
    return False


def localise(
    truth_norms, ranks: list[dict], indices: list[list[int]], final: list[list[float]], bound: float
) -> PerSampleLocalised:
    """`ranks`: each rank's traced_task output's "sent"; `indices`: each rank's own global sample indices;
    `final`: each rank's norms in global order after the exchange."""
    truth = torch.tensor(list(truth_norms), dtype=torch.float64)
    bad = [
        (r, k)
        for r, norms in enumerate(final)
        for k, x in enumerate(norms)
        if not abs(x - float(truth[k])) / abs(float(truth[k])) < bound
    ]
    if not bad:
        return PerSampleLocalised("nothing", None, None, ["every rank's norms match the truth: nothing to localise"])
    r_bad, k_bad = bad[0]
    hits = []
    for r, sent in enumerate(ranks):
        own = truth[torch.tensor(indices[r], dtype=torch.long)]
        hit = next((i for i, (_, args) in enumerate(sent) if any(_matches(a, own, bound) for a in args)), None)
        if hit is None:
            return PerSampleLocalised(
                "computation",
                r,
                None,
                [
                    f"computation on rank {r}: none of what it sent into its {len(sent)} collectives holds its own "
                    f"samples' norms ({len(indices[r])}) or their squares within {bound:g} of the truth (its own norms "
                    "were wrong before any exchange, or sent in a form this search does not read)"
                ],
            )
        hits.append(hit)
    i, kind = hits[r_bad], ranks[r_bad][hits[r_bad]][0]
    return PerSampleLocalised(
        "exchange",
        r_bad,
        f"#{i + 1} {kind}",
        [
            f"exchange: every rank's own samples' norms were right (within {bound:g}) when sent into a collective; "
            f"rank {r_bad}'s: collective #{i + 1}, {kind}",
            f"rank {r_bad}, sample {k_bad}: {final[r_bad][k_bad]:.6g} after the exchange, truth {float(truth[k_bad]):.6g}",
        ],
    )


def own_indices(batch: int, world_size: int, mode: str) -> list[list[int]]:
    """Each rank's global sample indices as the harness's data layout gives them (harness.train.data)."""
    from harness.train.data import local_slice

    ar = torch.arange(batch)
    return [local_slice(ar, ar, r, world_size, mode)[2].tolist() for r in range(world_size)]


def replay(pool, world_size: int, task: str, payload: dict, variant: str, truth_norms) -> PerSampleLocalised:
    """A norms task (`task`, "module:function", whose rank results hold {"norms": {variant: [...]}}) run again
    in `pool`'s world of `world_size` with the recorder on, for `variant` alone, and localised against
    `truth_norms`. `payload` gives the data layout (batch, mode) as the task reads it."""
    payload = {**payload, "variants": [variant]}
    ranks = pool.get(world_size, "gloo").call(TRACED_TASK, {"task": task, "payload": payload})
    return localise(
        truth_norms,
        [r["sent"] for r in ranks],
        own_indices(payload["batch"], world_size, payload["mode"]),
        [r["result"]["norms"][variant] for r in ranks],
        PER_SAMPLE_RTOL,
    )
