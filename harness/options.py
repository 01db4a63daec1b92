"""Typed option parsers shared by the pytest plugin and the CLI.

Each raises argparse.ArgumentTypeError with one clear line; callers turn it into a usage error.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.core import names
from harness.core.features import ACCUM_MICRO_BATCHES, HSDP_REPLICAS, RESHARD_RANKS, check_feature, has, passes_per_step
from harness.core.policy import Bounds
from harness.core.scenario import DATA_MODES, OPTIMIZERS, Scenario, build_matrix
from harness.report.runs import KEEP_RUNS

DEFAULT_IMPLS = ("fsdp_impl", "torch_fsdp2")
DEFAULT_MODELS = ("mlp", "tinylm", "tinylm_tied")
DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
DEFAULT_LOCALIZE = 2  # failing scenarios a run localises (harness.localize.auto)
# Generated output goes apart from the committed reports (git-ignored); the committed
# reports/verification.md is refreshed on purpose with --report reports/verification.md.
# the default report: written in a new folder reports/runs/<time>/, which reports/latest then points
# at (harness.report.runs), so that runs never replace each other's outputs
DEFAULT_REPORT = Path("reports/latest/verification.md")


def _items(text: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",")]
    if not text or not str(text).strip() or any(not t for t in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    dup = sorted({t for t in items if items.count(t) > 1})
    if dup:
        raise argparse.ArgumentTypeError(f"duplicate value(s) {', '.join(dup)} in {text!r}")
    return items


def world_sizes(text: str) -> tuple[int, ...]:
    out = []
    for item in _items(text):
        try:
            n = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer (e.g. --world-sizes 1,2,4,8)") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{n} is not a positive number of ranks")
        out.append(n)
    return tuple(out)


def choices(valid: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = _items(text)
        bad = [i for i in items if i not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; choose from {', '.join(valid)}")
        return tuple(items)

    return parse


data_modes = choices(DATA_MODES)


def optimizers(text: str) -> tuple[str, ...]:
    """Built-in names are checked by name; a user's 'package.module:factory' is imported and must be callable
    (harness/optimizers.py; harness.preflight then builds and steps it once)."""
    items = _items(text)
    for name in items:
        if name in OPTIMIZERS:
            continue
        if ":" not in name:
            raise argparse.ArgumentTypeError(
                f"unknown {name!r}; choose from {', '.join(OPTIMIZERS)}, or name your "
                f"own optimizer 'package.module:factory' (e.g. "
                f"harness.train.optim:normalised_sgd)"
            )
        from harness.optimizers import OptimizerError, load_user_optimizer

        try:
            load_user_optimizer(name)
        except OptimizerError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return tuple(items)


def features(text: str) -> tuple[str, ...]:
    """A comma list of cells, each a feature or features composed with '+' (run together, in one run)."""
    try:
        return tuple(dict.fromkeys(check_feature(i) for i in _items(text)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def models(text: str) -> tuple[str, ...]:
    """Zoo names are checked by name; a Hugging Face 'hf:<model>' by name and by transformers being
    importable; a user's 'package.module:factory' is imported and held to the model protocol
    (harness/train/user_models.py)."""
    items = _items(text)
    for name in items:
        if name in names.MODELS or name in names.STANDARD_MODELS:
            continue
        if ":" not in name:
            zoo = names.MODELS + names.STANDARD_MODELS
            raise argparse.ArgumentTypeError(
                f"unknown {name!r}; choose from {', '.join(zoo)}, "
                f"{', '.join(names.HF_MODELS)}, or name your own model "
                f"'package.module:factory'"
            )
        if name.startswith(names.HF_PREFIX) and name not in names.HF_MODELS:
            raise argparse.ArgumentTypeError(names.unknown_hf_model(name))  # before any torch import
        from harness.train.user_models import ModelError

        try:
            if name.startswith(names.HF_PREFIX):  # 'hf:gpt2': transformers must be importable
                from harness.train.hf_models import hf_model_spec

                hf_model_spec(name)
            else:
                from harness.train.user_models import load_user_model

                load_user_model(name)
        except ModelError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return tuple(items)


def impls(text: str) -> tuple[str, ...]:
    """Built-in names are checked by name (no torch import: a usage error stays instant); a user's
    'package.module:object' or 'cs336:module' is imported and checked against the protocol."""
    items = _items(text)
    for name in items:
        if name in names.BUILTIN_ADAPTERS:
            continue
        if ":" not in name:
            raise argparse.ArgumentTypeError(names.unknown_adapter(name))
        from harness.adapters import AdapterError, load_adapter

        try:
            load_adapter(name)
        except AdapterError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return tuple(items)


def _integer(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    n = _integer(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(text: str) -> int:
    n = _integer(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def steps(text: str) -> int:
    """At least 2: memory is measured on step 2 (harness.train.task.MEASURED_STEP: once optimizer state
    exists) and `converges` compares the last step's loss with the first's."""
    n = _integer(text)
    if n < 2:
        raise argparse.ArgumentTypeError(
            f"must be >= 2 (got {n}): memory is measured on step 2 and the "
            "convergence check compares the last step's loss with the first's"
        )
    return n


# torch.manual_seed takes -2**63 .. 2**64 - 1, but the stored tables hold seeds as int64.
SEED_RANGE = (-(2**63), 2**63 - 1)


def seeds(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in _items(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None
    low, high = SEED_RANGE
    bad = [n for n in out if not low <= n <= high]
    if bad:
        raise argparse.ArgumentTypeError(f"seed {bad[0]} is out of range: seeds are integers from {low} to {high}")
    return out


def _number(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_float(text: str) -> float:
    x = _number(text)
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return x


# A wait on the workers (multiprocessing.connection.wait: epoll) takes at most 2**31 - 1 ms.
MAX_TIMEOUT_S = 2147483
# The timeout also bounds a world's start (harness.execute.world.World): forking W ranks from the
# forkserver and joining them in one process group. A world of one rank starting and training the
# smallest scenario (mlp, 2 steps) takes a fraction of a second once the forkserver runs, its first start
# seconds more (reports/performance.md#world-start); below a second every scenario would read as hung, which
# tells the user nothing.
MIN_TIMEOUT_S = 1.0


def timeout_seconds(text: str) -> float:
    x = _number(text)
    if not 0 < x <= MAX_TIMEOUT_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S} (24 days), got {text}"
        )
    if x < MIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_TIMEOUT_S:g} s, got {text}: it also bounds a world's start (forking the ranks "
            f"and joining their process group), so a shorter one reports every scenario as hung"
        )
    return x


def report_path(text: str) -> Path:
    """A writable markdown path: probed by creating (and removing) a file where it will go."""
    import os
    import tempfile

    p = Path(text)
    if p.suffix != ".md":
        raise argparse.ArgumentTypeError(f"{text!r} must be a markdown file path ending in .md")
    try:  # a name longer than the file system takes (ENAMETOOLONG) fails the first look at it
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a directory")
        probe = p.parent if str(p.parent) else Path(".")
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot use the report path {_shortened(text)}: {e.strerror or e}") from None
    try:
        if not probe.is_dir():
            raise OSError(f"{probe} is not a directory")
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write the report under {probe}: {e.strerror or e}") from None
    return p


def _shortened(text: str, keep: int = 60) -> str:
    """A path for an error line: a long one shows its start and end around its length."""
    return (
        repr(text) if len(text) <= keep else f"{text[: keep // 2]!r}...{text[-keep // 2 :]!r} ({len(text)} characters)"
    )


def baseline_name(text: str) -> str:
    """A baseline name (file stem under reports/baselines/) or a path to a baseline file."""
    if not text or not str(text).strip():
        raise argparse.ArgumentTypeError("empty baseline name")
    if "/" not in text and not all(c.isalnum() or c in "-_." for c in text):
        raise argparse.ArgumentTypeError(f"baseline name {text!r}: use letters, digits, '-', '_' and '.' only")
    return text


def new_baseline_name(text: str) -> str:
    """A name to store a baseline under (reports/baselines/NAME/<machine kind>.json), never a path:
    the rule harness.gate.baseline.baseline_file enforces, checked here before the run."""
    from harness.gate.baseline import NAME_RULE

    if not re.fullmatch(NAME_RULE, text or "") or text in (".", ".."):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a baseline name: use letters, digits, '-', '_' and '.', starting with a letter or "
            "digit, no path (it is stored as reports/baselines/NAME/<machine kind>.json)"
        )
    return text


# [Note: an option given twice] argparse keeps the last value of an option given twice, silently: `--models a
# --models b` ran b alone. Every option of the harness that takes a value takes one (a list option one comma
# list), so a second one is a usage error, from the CLI and the pytest plugin alike. The check reads the command
# line itself (`repeated_option`): pytest parses its arguments more than once into the same namespace, so a
# count kept by an argparse action would see each option twice.


def repeated_option(args, value_options, long_options=()) -> str | None:
    """The first of `value_options` (option strings that take a value) that `args` give more than once, or None.
    `--name value` and `--name=value` both count; where `long_options` (every long option of the parser) is
    given, an unambiguous prefix counts as the option it abbreviates, as argparse reads it. Nothing after `--`."""
    known = set(long_options) | set(value_options)
    seen: set[str] = set()
    for token in args:
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if name not in known and long_options:
            matches = [o for o in long_options if o.startswith(name)]
            name = matches[0] if len(matches) == 1 else name
        if name not in value_options:
            continue
        if name in seen:
            return name
        seen.add(name)
    return None


def repeated_error(name: str, listed: bool | None = None) -> argparse.ArgumentTypeError:
    """The usage error for an option given twice (see [Note: an option given twice]); `listed`: it takes a comma
    list (None: as the add_* functions registered it)."""
    listed = name in _LIST_OPTIONS if listed is None else listed
    what = f"one comma-separated list ({name} a,b)" if listed else "one value"
    return argparse.ArgumentTypeError(
        f"{name} is given more than once: it takes {what}, and all but the last would be dropped silently"
    )


def check_not_repeated(args) -> None:
    """A usage error if `args` give one of the harness's own options that take a value more than once (the pytest
    plugin's check: [Note: an option given twice])."""
    name = repeated_option(args, _VALUE_OPTIONS)
    if name is not None:
        raise repeated_error(name)


_VALUE_OPTIONS: set[str] = set()  # every option the add_* functions registered that takes a value
_LIST_OPTIONS: set[str] = set()  # those of them that take a comma list
LIST_TYPES = (world_sizes, impls, models, data_modes, optimizers, features, seeds)


def _recording(add):
    """`add`, recording which options take a value (and a list) for `check_not_repeated`."""

    def recorded(name: str, **kw):
        if kw.get("action") not in ("store_true", "store_false", "count"):
            _VALUE_OPTIONS.add(name)
            if kw.get("type") in LIST_TYPES:
                _LIST_OPTIONS.add(name)
        return add(name, **kw)

    return recorded


def gate_spec(text: str) -> dict:
    from harness.gate.tolerance import parse_gate

    return parse_gate(text)


def add_output_arguments(add) -> None:
    """--report, --no-report, --no-plots, --per-sample, --invariant, --localize: what a session adds to the matrix and
    writes."""
    add = _recording(add)
    add(
        "--report",
        type=report_path,
        default=None,
        help="markdown report, written exactly there with <stem>_plots/ and <stem>_tables/ beside it (default: "
        f"{DEFAULT_REPORT.name} in a new folder reports/runs/<time>/, which {DEFAULT_REPORT.parent} points at; "
        f"the newest {KEEP_RUNS} runs are kept)",
    )
    add("--no-report", action="store_true", help="write no report and no tables")
    add(
        "--no-plots",
        action="store_true",
        help="write the report without its plots (drawing them is most of the report's time; the report says where "
        "each would be)",
    )
    add(
        "--per-sample",
        action="store_true",
        help="also check per-sample gradient norms (DP-SGD) at the same world sizes (mlp; Opacus if installed)",
    )
    add(
        "--invariant",
        action="store_true",
        help="also run the batch-invariant tier: every --impl that declares batch_invariant trained through its own "
        "invariant step at every --world-sizes, split and replicated data, held bitwise to itself and to the "
        "plain model summing the same micro-batches in the same tree (harness/invariant)",
    )
    add(
        "--localize",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=f"after the run, localise the first N scenarios with a failing numeric check (default {DEFAULT_LOCALIZE}; "
        "0: none): "
        "each is replayed with its yardstick, every op traced, and the report's 'Where it diverged' names "
        "the step, phase, module, op, rank and element where they first parted",
    )


def run_options_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser of `harness run`'s matrix and output options, for a tool that makes such a run (the benches)."""
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_matrix_arguments(p.add_argument)
    add_output_arguments(p.add_argument)
    return p


def add_gate_arguments(add) -> None:
    add = _recording(add)
    add(
        "--baseline",
        type=baseline_name,
        default=None,
        help="compare the run with this baseline (name under reports/baselines/ or a path); regressions fail",
    )
    add(
        "--save-baseline",
        type=new_baseline_name,
        default=None,
        help="store this run's summary as reports/baselines/NAME/<machine kind>.json (a name, not a path)",
    )
    add(
        "--gate",
        type=gate_spec,
        default=None,
        help="per-field tolerances, e.g. loss:1e-7,peak_mem:5%%,comm_bytes:0 (defaults in harness/gate/tolerance.py)",
    )
    add(
        "--gate-strict",
        action="store_true",
        help="fail the run when the gate compared nothing (no baseline file for this machine kind, no scenario in "
        "common, every field skipped); without it such a gate is reported, not failed",
    )


def load_baseline_option(name, gate=None, backend: str = "gloo", strict: bool = False):
    """Load a --baseline value early (the file of this machine kind, harness.gate.baseline) so a missing
    or corrupt file is one usage-error line."""
    if gate is not None and name is None:
        raise argparse.ArgumentTypeError(
            "--gate needs --baseline NAME (its tolerances apply to a comparison with a baseline)"
        )
    if strict and name is None:
        raise argparse.ArgumentTypeError("--gate-strict needs --baseline NAME (it fails a gate that compared nothing)")
    if name is None:
        return None
    from harness.core.environment import kernel_env, machine_kind
    from harness.gate.baseline import BaselineError, load_baseline

    try:
        return load_baseline(name, kind=machine_kind(kernel_env(backend)))
    except BaselineError as e:
        raise argparse.ArgumentTypeError(f"--baseline: {e}") from None


@dataclass(frozen=True)
class MatrixOptions:
    impls: tuple[str, ...] = DEFAULT_IMPLS
    models: tuple[str, ...] = DEFAULT_MODELS
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    data_modes: tuple[str, ...] = DATA_MODES
    optimizers: tuple[str, ...] = OPTIMIZERS
    steps: int = 10
    seeds: tuple[int, ...] = (0,)
    lr: float = 1e-2
    global_batch: int = 16
    backend: str = "gloo"
    timeout_s: float = 300.0
    bounds: Bounds = field(default_factory=Bounds)
    features: tuple[str, ...] = ("plain",)
    allow_large: bool = False  # lift the machine-derived upper limits (harness/limits.py)

    def validate(self) -> None:
        """Cross-option checks; raises argparse.ArgumentTypeError with one line."""
        if "split" in self.data_modes:
            bad = [w for w in self.world_sizes if self.global_batch % w]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"--data-modes split needs the global batch ({self.global_batch}) divisible by every world size; "
                    f"{bad} do not divide it (set --global-batch)"
                )
        if any(has(f, "hsdp") for f in self.features):
            odd = [w for w in self.world_sizes if w > 1 and w % HSDP_REPLICAS]
            if odd:
                raise argparse.ArgumentTypeError(
                    f"--features hsdp runs {HSDP_REPLICAS} replicas of W/{HSDP_REPLICAS} ranks each, so a world size "
                    f"above 1 must divide by {HSDP_REPLICAS}; {odd} do not (1 is one replica of one rank, the "
                    f"comparison run)"
                )
        if any(has(f, "reshard2") for f in self.features):
            odd = [w for w in self.world_sizes if w > RESHARD_RANKS and w % RESHARD_RANKS]
            if odd:
                raise argparse.ArgumentTypeError(
                    f"--features reshard2 reshards each unit to groups of {RESHARD_RANKS} ranks after forward, so a "
                    f"world size above {RESHARD_RANKS} must divide by {RESHARD_RANKS}; {odd} do not"
                )
        if any(passes_per_step(f) > 1 for f in self.features):
            k = ACCUM_MICRO_BATCHES
            per = [
                (w, self.global_batch // w if "split" in self.data_modes else self.global_batch)
                for w in self.world_sizes
            ]
            bad = [w for w, n in per if n % k]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"--features {'/'.join(f for f in self.features if passes_per_step(f) > 1)} splits each rank's batch into "
                    f"{k} micro-batches; at world size(s) {bad} the "
                    f"local batch of global batch {self.global_batch} does not divide by {k} (set --global-batch)"
                )
        if self.backend == "nccl":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            too_big = [w for w in self.world_sizes if w > n]
            if too_big:
                raise argparse.ArgumentTypeError(
                    f"--world-sizes: {max(too_big)} ranks need {max(too_big)} GPUs with --backend nccl; this machine has {n}"
                )

    def scenarios(self) -> list[Scenario]:
        return build_matrix(
            self.impls,
            self.models,
            self.world_sizes,
            self.data_modes,
            self.optimizers,
            steps=self.steps,
            seeds=self.seeds,
            lr=self.lr,
            global_batch=self.global_batch,
            backend=self.backend,
            features=self.features,
        )


def add_matrix_arguments(add) -> None:
    """Register the matrix options with an argparse-like `add(name, **kw)` (argparse or pytest)."""
    add = _recording(add)
    add("--world-sizes", type=world_sizes, default=None, help="comma list of world sizes (default 1,2,4,8)")
    add(
        "--impl",
        dest="impls",
        type=impls,
        default=None,
        help="implementations under test: fsdp_impl, torch_fsdp2, torch_fsdp2_fp64reduce, torch_fsdp1, ddp, "
        "package.module:object, cs336:module (default fsdp_impl,torch_fsdp2)",
    )
    add(
        "--models",
        type=models,
        default=None,
        help="model zoo names, Hugging Face hf:gpt2,hf:llama (pip install -e .[hf]), or package.module:factory "
        "(default mlp,tinylm,tinylm_tied)",
    )
    add("--data-modes", type=data_modes, default=None, help="replicated,split (default both)")
    add(
        "--optimizers",
        type=optimizers,
        default=None,
        help="adamw, sgd, or package.module:factory, called as factory(params, lr=lr) and returning a "
        "torch.optim.Optimizer (the zoo's per-matrix harness.train.optim:normalised_sgd) (default adamw,sgd)",
    )
    add(
        "--features",
        type=features,
        default=None,
        help="what a step does: plain (one forward and backward), accum (2 micro-batches, a backward each, "
        "one optimizer step), no_sync (the same with the reduction switched off on all but the last), "
        "clip / clip_inf (global gradient-norm clipping, L2 / infinity), ac (activation checkpointing on "
        "every unit), ckpt (resumed at each world size from a sharded checkpoint saved at every other one), "
        "bf16 (bf16 compute, fp32 master weights and reduction), hsdp (2 replicas x W/2 shards), eval (a no_grad "
        "forward on a held-out batch after each step), jitter (seeded delays where asynchronous work races; the "
        "numbers must not change), reshard2 (after forward each unit resharded to groups of 2 ranks: an integer "
        "reshard_after_forward; the numbers must not change), shard1 (parameters sharded on dim 1 where it divides "
        "evenly: a custom shard placement; the numbers must not change). A comma list "
        "runs each as its own cells; '+' composes features in one run (hsdp+clip, accum+clip+bf16), "
        "compared with the plain model doing the same composition (default plain)",
    )
    add("--steps", type=steps, default=None, help="training steps per scenario, at least 2 (default 10)")
    add("--seeds", type=seeds, default=None, help="comma list of seeds (default 0)")
    add("--lr", type=positive_float, default=None, help="learning rate (default 1e-2)")
    add("--global-batch", type=positive_int, default=None, help="global batch size (default 16)")
    add("--backend", choices=("gloo", "nccl"), default=None, help="gloo (CPU, default) or nccl (CUDA)")
    add(
        "--scenario-timeout",
        type=timeout_seconds,
        default=None,
        help="seconds before a scenario counts as hung (default 300)",
    )
    add(
        "--cross-ws-bound",
        type=positive_float,
        default=None,
        help="max |param diff| vs world size 1 with replicated data (default 3e-8)",
    )
    add_allow_large(add)


def add_allow_large(add) -> None:
    add = _recording(add)
    add(
        "--allow-large",
        action="store_true",
        default=None,
        help="lift the upper limits derived from this machine (world size by memory, steps by the temp dir's free "
        "space, planner world size by the model's rows; harness/limits.py)",
    )


def matrix_from(ns) -> MatrixOptions:
    """Build MatrixOptions from parsed values (None = default), each value checked on its own and against the
    others; what needs the models built or the machine looked at is harness.preflight's (`checked_matrix`)."""
    d = MatrixOptions()
    pick = lambda name, default: default if getattr(ns, name, None) is None else getattr(ns, name)  # noqa: E731
    bound = getattr(ns, "cross_ws_bound", None)
    opts = MatrixOptions(
        impls=pick("impls", d.impls),
        models=pick("models", d.models),
        world_sizes=pick("world_sizes", d.world_sizes),
        data_modes=pick("data_modes", d.data_modes),
        optimizers=pick("optimizers", d.optimizers),
        steps=pick("steps", d.steps),
        seeds=pick("seeds", d.seeds),
        lr=pick("lr", d.lr),
        global_batch=pick("global_batch", d.global_batch),
        backend=pick("backend", d.backend),
        timeout_s=pick("scenario_timeout", d.timeout_s),
        features=pick("features", d.features),
        bounds=Bounds(cross_ws_replicated=bound) if bound else Bounds(),
        allow_large=bool(getattr(ns, "allow_large", False)),
    )
    opts.validate()
    return opts


@dataclass(frozen=True)
class SessionOptions:
    matrix: MatrixOptions
    # None: write no outputs (report, tables) at all; DEFAULT_REPORT: in a new folder under
    # reports/runs/, which reports/latest then points at (harness.report.runs)
    report: Path | None = DEFAULT_REPORT
    per_sample: bool = False
    baseline: str | None = None  # a name under reports/baselines/ or a path
    gate: dict | None = None  # per-field tolerances (harness.gate.tolerance.parse_gate)
    save_baseline: str | None = None
    gate_strict: bool = False  # a gate that compared nothing fails (harness.gate.compare)
    localize: int = DEFAULT_LOCALIZE  # failing scenarios localised after the run (harness.localize.auto)
    invariant: bool = False  # the batch-invariant tier after the matrix (harness.invariant)
    plots: bool = True  # the report's plots drawn (--no-plots: not)

    @classmethod
    def from_namespace(cls, ns, matrix: MatrixOptions) -> SessionOptions:
        """From parsed CLI or pytest options (the names `add_*_arguments` register) and the matrix made of them."""
        report = None if getattr(ns, "no_report", False) else getattr(ns, "report", None) or DEFAULT_REPORT
        return cls(
            matrix,
            report,
            bool(getattr(ns, "per_sample", False)),
            getattr(ns, "baseline", None),
            getattr(ns, "gate", None),
            getattr(ns, "save_baseline", None),
            bool(getattr(ns, "gate_strict", False)),
            _localize_count(ns),
            bool(getattr(ns, "invariant", False)),
            not getattr(ns, "no_plots", False),
        )


def _localize_count(ns) -> int:
    value = getattr(ns, "localize", None)
    return DEFAULT_LOCALIZE if value is None else int(value)
