"""Replay a scenario and its yardstick with every rank traced, and say where they parted.

The yardstick is the plain model in one process on the same global batch, doing the steps the scenario's
own reference does (harness.core.scenario.Scenario.reference); with split data it sums the W ranks'
slices as micro-batches (rank r's slice as its micro-batch r), so that each of a rank's passes has a
counterpart computed on the same samples with the same shapes. Two runs per localisation (three for a
resumed run: its checkpoint's saver runs first, traced up to its save, and the yardstick starts the resumed
run's first step from what the saver's ranks held: the checkpoint load is held to the saved parameters).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.core.features import has, passes_per_step
from harness.core.scenario import OPTIMIZERS, REFERENCE_IMPL, Scenario, ckpt_step
from harness.localize.compare import Point, localise
from harness.train.params_file import save_params

KEEP_BYTES = 32 << 20  # per rank: op outputs kept with their values (beyond it, hashes only)


def yardstick(sc: Scenario) -> Scenario:
    """The plain run `sc` is localised against (see the module docstring)."""
    ref = sc.reference()
    if sc.data_mode == "split" and sc.world_size > 1:
        ref = ref.replace(micro_batches=sc.world_size)
    return ref


@dataclass
class Localised:
    scenario: Scenario
    yardstick: Scenario
    point: Point | None
    steps: list[int]

    @property
    def diverged(self) -> bool:
        """Whether the run parted from its yardstick beyond a reduction's rounding."""
        return self.point is not None and not self.point.rounding

    def short(self) -> str:
        """The chain on one line."""
        p = self.point
        if p is None:
            return "no divergence from the yardstick in the traced steps"
        parts = [f"step {p.step}"] + ([f"micro-batch {p.pass_}"] if p.pass_ is not None else [])
        parts += [
            p.phase + (" (rounding only)" if p.rounding else ""),
            p.module,
            p.op,
            f"rank{'s' if len(p.ranks) > 1 else ''} {','.join(map(str, p.ranks))}",
            p.detail,
        ]
        return ", ".join(parts)

    def lines(self) -> list[str]:
        """The chain, one level per line."""
        sc, p = self.scenario, self.point
        head = f"{sc.id} against {self.yardstick.id}, steps {self.steps[0]}-{self.steps[-1]}:"
        if p is None:
            return [
                head,
                "  no divergence: every traced op and every rank's parameters, gradients and updates "
                "match the yardstick bit for bit",
            ]
        if p.rounding:
            head += (
                " no divergence beyond rounding: the gradients after the reduction differ from the "
                "yardstick's by no more than summing the same terms in another order gives (2 (n-1) u "
                "sum|g_i| per element), first at"
            )
        lines = [head, f"  step         {p.step}"]
        if p.pass_ is not None:
            lines.append(f"  micro-batch  {p.pass_} of {passes_per_step(sc.feature)} on the rank")
        lines += [
            f"  phase        {p.phase}" + (" (rounding only)" if p.rounding else ""),
            f"  module       {p.module}",
            f"  op           {p.op}",
            f"  rank         {', '.join(map(str, p.ranks))} of {sc.world_size}",
            f"  element      {p.detail}",
        ]
        if p.context:
            lines.append(
                f"  {'the yardstick: ops of that module around it':<46} {'the rank: the ops in their place':<40}"
            )
            lines += [f"    {ref:<44} {mine:<40} {mark}" for ref, mine, mark in p.context]
        return lines


def replay(sc: Scenario, *, pool, workdir: Path, steps: int | None = None, keep_bytes: int = KEEP_BYTES) -> Localised:
    """Run `sc` and its yardstick traced up to `steps` (default: all) in `pool`'s worlds, and compare."""
    from harness.execute.executor import TASK, payload_of

    last = min(steps or sc.steps, sc.steps)
    ref = yardstick(sc)
    savers = {sc.saver()} if sc.saver() is not None else set()
    traced = {"steps": last, "keep_bytes": keep_bytes}
    start = ckpt_step(sc.steps) if has(sc.feature, "ckpt") and sc.resume_from else 0
    step_list = list(range(start + 1, last + 1))

    def run(scenario: Scenario, trace: dict | None) -> None:
        payload = payload_of(scenario, workdir, savers)
        if trace is not None:
            payload["trace"] = trace
        pool.get(scenario.world_size, scenario.backend).call(TASK, payload)

    force_dir = workdir / "forced"
    force_dir.mkdir(exist_ok=True)
    saved = {}
    for saver in savers:  # what it saved: the parameters the resumed run must load, from the saver's ranks
        run(saver, {"steps": start, "keep_bytes": 0})
        saved = assemble(_load(workdir / saver.id / "trace", saver.world_size), start)
        save_params(saved, force_dir / f"step{start}.pt")
    run(sc, traced)
    traces = _load(workdir / sc.id / "trace", sc.world_size)
    # the gradients the run applied, for the yardstick's optimizer; not for a resumed run (its optimizer state is
    # its saver's: nothing to force it to), nor a user's optimizer, which may reduce over a whole matrix
    # (harness.train.optim.normalised_sgd) in the order a sharded run chooses: only the harness's elementwise
    # optimizers are held bit for bit on the same inputs
    force_grads = not start and sc.optimizer in OPTIMIZERS
    for step in step_list:  # what the run under test holds after each step and applied in it, from its ranks
        full = assemble(traces, step)
        if full and step != step_list[-1]:
            save_params(full, force_dir / f"step{step}.pt")
        applied = force_grads and (assemble(traces, step, "grads_clipped") or assemble(traces, step, "grads_reduced"))
        if applied:
            save_params(applied, force_dir / f"grads{step}.pt")
    run(
        ref,
        {
            **traced,
            "pass_grads": ref.micro_batches * passes_per_step(ref.feature) > 1,
            "slices_summed": ref.micro_batches > 1,
            "force_dir": str(force_dir),
        },
    )
    ref_trace = _load(workdir / ref.id / "trace", 1)[0]
    # a checkpoint saved at another world size carries that trajectory's rounding (and its optimizer state's)
    natural = next(
        (st["params"] for st in ref_trace["state"] if st["step"] == start and st["what"] == "params_after"), {}
    )
    carried = any(name in natural and not torch.equal(full, natural[name][1]) for name, full in saved.items())
    point = localise(
        ref_trace,
        traces,
        split=sc.data_mode == "split" and sc.world_size > 1,
        passes=passes_per_step(sc.feature),
        steps=step_list,
        resumed_at=start,
        carried=carried,
    )
    return Localised(sc, ref, point, step_list)


def assemble(traces: list[dict], step: int, what: str = "params_after") -> dict[str, torch.Tensor]:
    """The full parameters after `step` (or what else the tracer kept: "grads_reduced", "grads_clipped"), put
    together from the rows every rank held (its own word is not asked: harness.train.trace keeps what the
    rank holds). A parameter no rank holds whole or as dim-0 rows covering it is left out (the yardstick keeps
    its own)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for trace in traces:
        state = next((s["params"] for s in trace["state"] if s["step"] == step and s["what"] == what), {})
        for name, (rows, local) in state.items():
            pieces.setdefault(name, {})
            if rows is None:
                pieces[name].setdefault(-1, local)
            elif rows[1] > rows[0]:
                pieces[name].setdefault(rows[0], local[: rows[1] - rows[0]])
    full = {}
    for name, parts in pieces.items():
        if -1 in parts:  # a whole copy
            full[name] = parts[-1]
            continue
        at, chunks = 0, []
        for first in sorted(parts):
            if first != at:
                break
            chunks.append(parts[first])
            at += parts[first].shape[0]
        else:
            full[name] = torch.cat(chunks)
    return full


def _load(folder: Path, ranks: int) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def replay_or_why(sc: Scenario, *, pool, steps: int | None = None) -> tuple[Localised | None, str]:
    """`replay` in `pool`'s worlds and a temp dir of its own: (its Localised, ""), or (None, the last line of
    what kept it from running): the run stays judged as it was, and says why it could not be localised."""
    with tempfile.TemporaryDirectory(prefix="fsdp-localize-") as d:
        try:
            return replay(sc, pool=pool, workdir=Path(d), steps=steps), ""
        except Exception as e:
            return None, (str(e).strip().splitlines() or [type(e).__name__])[-1]


def localize(sc: Scenario, *, steps: int | None = None, timeout_s: float = 300.0) -> Localised:
    """`replay` in worlds and a temp dir of its own."""
    from harness.execute.world import WorldPool

    if sc.impl == REFERENCE_IMPL:
        raise ValueError(f"{sc.id} is the plain reference itself: there is nothing to localise it against")
    with WorldPool(timeout_s=timeout_s) as pool, tempfile.TemporaryDirectory(prefix="fsdp-localize-") as d:
        return replay(sc, pool=pool, workdir=Path(d), steps=steps)


def scenario_of_id(
    text: str, *, steps: int = 10, lr: float = 1e-2, global_batch: int = 16, backend: str = "gloo"
) -> Scenario:
    """The scenario an id names (harness.core.scenario.scenario_id), with the run's steps, lr and global batch
    (an id does not carry them); ValueError (one line) for text that is not such an id."""
    import re

    from harness.core.features import check_feature
    from harness.core.names import BUILTIN_ADAPTERS, HF_PREFIX, MODELS, STANDARD_MODELS
    from harness.core.scenario import DATA_MODES, OPTIMIZERS

    tokens = text.strip().split("-")
    at = next((i for i, t in enumerate(tokens) if re.fullmatch(r"ws\d+", t) and i >= 2), None)
    # a user's optimizer 'pkg.mod:factory' is spelled 'pkg.mod.factory' (scenario_id's slug)
    if (
        at is None
        or len(tokens) < at + 3
        or tokens[at + 1] not in DATA_MODES
        or not (tokens[at + 2] in OPTIMIZERS or "." in tokens[at + 2])
    ):
        raise ValueError(
            f"{text!r} is not a scenario id (impl-model-wsW-mode-optimizer[-feature][-fromW][-seedN], "
            "as the report and the console name them)"
        )
    impl, model = "-".join(tokens[: at - 1]), tokens[at - 1]
    if impl not in BUILTIN_ADAPTERS:
        impl = "cs336:" + impl[len("cs336.") :] if impl.startswith("cs336.") else ":".join(impl.rsplit(".", 1))
    if model not in MODELS + STANDARD_MODELS:
        model = HF_PREFIX + model[3:] if model.startswith("hf.") else ":".join(model.rsplit(".", 1))
    fields = {"feature": "plain"}
    for t in tokens[at + 3 :]:
        for key, pattern in (("resume_from", r"from(\d+)"), ("seed", r"seed(\d+)"), ("nudge", r"nudge(\d+)")):
            m = re.fullmatch(pattern, t)
            if m:
                fields[key] = int(m.group(1))
                break
        else:
            if re.fullmatch(r"micro\d+(rev)?", t):
                raise ValueError(f"{text!r} is a reference or noise probe: there is nothing to localise it against")
            fields["feature"] = check_feature(t)
    optimizer = tokens[at + 2] if tokens[at + 2] in OPTIMIZERS else ":".join(tokens[at + 2].rsplit(".", 1))
    return Scenario(
        impl,
        model,
        int(tokens[at][2:]),
        tokens[at + 1],
        optimizer,
        steps=steps,
        lr=lr,
        global_batch=global_batch,
        backend=backend,
        **fields,
    )
