"""Bad input for `python -m harness run`, its other verbs (localize, plan, compare, report) and the pytest plugin,
and what each one gets.

``probe_all`` runs every case below as a process of its own (the CLI, and the pytest plugin for the
cases marked so) and gives each one's exit code and exact error line; ``python -m reports.bad_inputs``
writes them as ``reports/bad_inputs.md``. A case that sets environment variables runs in a fresh process;
every other one in a fork of one process that has imported torch (``probe_forked``,
suites/faults/warm_cli.py), which runs the same entry point with the same argv and output.
``test_bad_inputs.py`` runs the same cases and asserts: exit 2 (CLI) / 4 (pytest's usage error),
exactly one error line that contains ``expect``, no traceback.

Every case of `run` completes its options from a tiny valid matrix, so an input that is NOT rejected
costs one short run instead of the default matrix; a case of another verb gives its whole command line.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from suites.faults import warm_cli

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--world-sizes",
    "1",
    "--impl",
    "fsdp_impl",
    "--models",
    "mlp",
    "--data-modes",
    "replicated",
    "--optimizers",
    "adamw",
    "--steps",
    "2",
]
CLI_USAGE_EXIT, PYTEST_USAGE_EXIT = 2, 4  # argparse's exit code; pytest's ExitCode.USAGE_ERROR
BROKEN_MODULE = "fsdp_harness_broken_adapter"  # written into a temp dir on PYTHONPATH: raises on import


class HalfAdapter:
    """Has wrap() but no full_params(): does not satisfy the adapter protocol."""

    def wrap(self, model, units, *, group, device):
        return model


half_adapter = HalfAdapter()


def raising_model():
    """A user model factory that raises."""
    raise RuntimeError("no weights here")


def half_model():
    """A user model factory whose object has build and units but no make_batch or loss."""
    return SimpleNamespace(build=lambda: None, units=lambda m: [])


def optimizer_returning_none(params, lr):
    """A user optimizer factory that returns no optimizer."""
    return None


def raising_optimizer(params, lr):
    """A user optimizer factory that raises."""
    raise RuntimeError("no optimizer here")


def optimizer_whose_step_raises(params, lr):
    """A user optimizer factory whose optimizer cannot step."""
    import torch

    class Stuck(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("stuck")

    return Stuck(params, lr=lr)


@dataclass(frozen=True)
class Case:
    what: str  # the kind of bad input, as the issue lists it
    args: tuple[str, ...]  # the bad options, completed from TINY; "{tmp}" is the probe's temp dir
    expect: str  # a fragment the error line must contain
    pytest: bool = False  # also try it through `python -m pytest suites/harness/end_to_end/test_equivalence.py`
    env: tuple[tuple[str, str], ...] = ()  # environment variables set for the probe; "{tmp}" as in args
    varies: bool = False  # the line names this machine's figures (memory, free space, GPUs): see stable()
    verb: str = "run"  # the CLI's verb; other than run, `args` is the whole command after it (no TINY)


CASES: tuple[Case, ...] = (
    Case("world size 0", ("--world-sizes", "0"), "0 is not a positive number of ranks", pytest=True),
    Case("negative world size", ("--world-sizes", "-2"), "-2 is not a positive number of ranks"),
    Case("world size as text", ("--world-sizes", "two"), "'two' is not an integer", pytest=True),
    Case("empty world sizes", ("--world-sizes", ""), "expected a comma-separated list"),
    Case("empty item in world sizes", ("--world-sizes", "1,,2"), "expected a comma-separated list"),
    Case("duplicate world sizes", ("--world-sizes", "1,2,2"), "duplicate value(s) 2"),
    Case(
        "more ranks than GPUs with NCCL",
        ("--backend", "nccl", "--world-sizes", "1024"),
        "1024 ranks need 1024 GPUs with --backend nccl",
        pytest=True,
        varies=True,
    ),
    Case(
        "more ranks than the machine's memory holds",
        ("--world-sizes", "1,100000"),
        "ranks fit this machine's memory",
        pytest=True,
        varies=True,
    ),
    Case("unknown implementation", ("--impl", "fsdp_imp"), "unknown adapter 'fsdp_imp'", pytest=True),
    Case("unknown model", ("--models", "resnet"), "unknown 'resnet'; choose from"),
    Case(
        "unknown Hugging Face model",
        ("--models", "hf:gpt3"),
        "unknown Hugging Face model 'hf:gpt3'; valid: hf:gpt2, hf:llama",
        pytest=True,
    ),
    Case(
        "user model module that is not there",
        ("--models", "no_such_pkg.models:spec"),
        "model 'no_such_pkg.models:spec': module 'no_such_pkg.models' could not be imported",
        pytest=True,
    ),
    Case(
        "user model object that is not in the module",
        ("--models", "suites.faults.bad_inputs:no_such_model"),
        "has no attribute 'no_such_model'",
    ),
    Case(
        "user model factory that raises",
        ("--models", "suites.faults.bad_inputs:raising_model"),
        "calling raising_model() failed: RuntimeError: no weights here",
    ),
    Case(
        "user model factory returning the wrong thing",
        ("--models", "suites.faults.bad_inputs:half_model"),
        "has no make_batch(), loss() (a model needs build, make_batch, loss, units",
        pytest=True,
    ),
    Case(
        "user model whose loss is a sum over the batch",
        ("--models", "suites.faults.bad_models:sum_loss"),
        "is not the mean over the batch: the loss of a batch of 16 is 2.000x the mean of its two halves' losses "
        "(a sum over the samples: reduction='sum'?)",
        pytest=True,
    ),
    Case(
        "user model whose build() returns no module",
        ("--models", "suites.faults.bad_models:build_returns_none"),
        "build() returned NoneType, not an nn.Module",
        pytest=True,
    ),
    Case(
        "user model whose units are not submodules",
        ("--models", "suites.faults.bad_models:units_not_submodules"),
        "units(model) returned Linear, which are not submodules of the model",
    ),
    Case(
        "user model whose batch has the wrong size",
        ("--models", "suites.faults.bad_models:batch_one_short"),
        "make_batch(16, ...) returned 15 inputs and 15 targets; both must hold 16 samples",
    ),
    Case(
        "user model whose forward raises on its own batch",
        ("--models", "suites.faults.bad_models:forward_raises"),
        "loss(model(inputs), targets) raised RuntimeError: ",
    ),
    Case("unknown data mode", ("--data-modes", "sharded"), "unknown 'sharded'; choose from"),
    Case("unknown optimizer", ("--optimizers", "lamb"), "unknown 'lamb'; choose from"),
    Case(
        "user optimizer module that is not there",
        ("--optimizers", "no_such_pkg.optim:lion"),
        "optimizer 'no_such_pkg.optim:lion': module 'no_such_pkg.optim' could not be imported",
        pytest=True,
    ),
    Case(
        "user optimizer that is not callable",
        ("--optimizers", "suites.faults.bad_inputs:half_adapter"),
        "half_adapter is a HalfAdapter, not a callable factory(params, lr=lr)",
    ),
    Case(
        "user optimizer factory that raises",
        ("--optimizers", "suites.faults.bad_inputs:raising_optimizer"),
        "factory(params, lr=0.01) raised RuntimeError: no optimizer here",
    ),
    Case(
        "user optimizer factory returning the wrong thing",
        ("--optimizers", "suites.faults.bad_inputs:optimizer_returning_none"),
        "factory(params, lr=0.01) returned NoneType, not a torch.optim.Optimizer",
        pytest=True,
    ),
    Case(
        "user optimizer that cannot step",
        ("--optimizers", "suites.faults.bad_inputs:optimizer_whose_step_raises"),
        "step() raised RuntimeError: stuck",
    ),
    Case(
        "unknown feature",
        ("--features", "accumulate"),
        "unknown feature 'accumulate'; choose from plain, accum, no_sync, clip, clip_inf, ac",
    ),
    Case(
        "features that cannot be composed",
        ("--features", "accum+no_sync"),
        "accum+no_sync cannot be composed: two micro-batch schemes",
    ),
    Case(
        "adapter module that is not there",
        ("--impl", "no_such_pkg.adapters:Mine"),
        "module 'no_such_pkg.adapters' could not be imported",
        pytest=True,
    ),
    Case(
        "adapter module that raises on import",
        ("--impl", f"{BROKEN_MODULE}:adapter"),
        f"module '{BROKEN_MODULE}' could not be imported: RuntimeError: broken on purpose",
    ),
    Case(
        "adapter object that is not in the module",
        ("--impl", "suites.faults.bad_inputs:no_such_adapter"),
        "has no attribute 'no_such_adapter'",
    ),
    Case(
        "adapter lacking the protocol",
        ("--impl", "suites.faults.bad_inputs:half_adapter"),
        "has no full_params() method",
        pytest=True,
    ),
    Case("report path under a regular file", ("--report", "{tmp}/a_file/r.md"), "is not a directory", pytest=True),
    Case("report path in /proc", ("--report", "/proc/fsdp-harness/r.md"), "cannot write"),
    Case(
        "report path too long for the file system",
        ("--report", "a" * 300 + "/r.md"),
        "cannot use the report path",
        pytest=True,
    ),
    Case("report path not markdown", ("--report", "{tmp}/r.txt"), "must be a markdown file path ending in .md"),
    Case("zero steps", ("--steps", "0"), "--steps: must be >= 2 (got 0)"),
    Case("one step", ("--steps", "1"), "--steps: must be >= 2 (got 1): memory is measured on step 2", pytest=True),
    Case(
        "more steps than the temp dir has room for",
        ("--steps", "1000000000"),
        "--steps 1000000000: the run keeps every step's parameter snapshot",
        pytest=True,
        varies=True,
        env=(("TMPDIR", "{tmp}"),),
    ),
    Case(
        "TMPDIR that cannot take a file",
        (),
        "TMPDIR /proc/fsdp-harness is not writable: No such file or directory",
        pytest=True,
        env=(("TMPDIR", "/proc/fsdp-harness"),),
    ),
    Case(
        "torchrun variables left over from another job",
        (),
        "TORCHELASTIC_RUN_ID=old-job and RANK=1 are set, but TORCHELASTIC_USE_AGENT_STORE, which torchrun's agent "
        "sets with them, is not",
        env=(
            ("TORCHELASTIC_RUN_ID", "old-job"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ),
    ),
    Case(
        "zero scenario timeout",
        ("--scenario-timeout", "0"),
        "--scenario-timeout: must be a finite number of seconds > 0 and at most 2147483 (24 days), got 0",
    ),
    Case("infinite scenario timeout", ("--scenario-timeout", "inf"), "--scenario-timeout: must be a finite number"),
    Case("NaN scenario timeout", ("--scenario-timeout", "nan"), "--scenario-timeout: must be a finite number"),
    Case("scenario timeout longer than a wait can be", ("--scenario-timeout", "1e9"), "at most 2147483"),
    Case(
        "scenario timeout too short to start a world",
        ("--scenario-timeout", "0.001"),
        "--scenario-timeout: must be at least 1 s, got 0.001",
        pytest=True,
    ),
    Case("scenario timeout as text", ("--scenario-timeout", "soon"), "'soon' is not a number"),
    Case("infinite learning rate", ("--lr", "inf"), "--lr: must be a finite number > 0, got inf"),
    Case("NaN learning rate", ("--lr", "nan"), "--lr: must be a finite number > 0, got nan"),
    Case("seeds as text", ("--seeds", "a"), "--seeds: expected integers"),
    Case(
        "seed too large for torch",
        ("--seeds", "99999999999999999999"),
        "--seeds: seed 99999999999999999999 is out of range: seeds are integers from -9223372036854775808 to "
        "9223372036854775807",
    ),
    Case(
        "baseline to save given as a path",
        ("--save-baseline", "../x"),
        "--save-baseline: '../x' is not a baseline name",
        pytest=True,
    ),
    Case("baseline to save named '..'", ("--save-baseline", ".."), "--save-baseline: '..' is not a baseline name"),
    Case(
        "conflicting pair: split data, batch not divisible",
        ("--world-sizes", "1,2", "--data-modes", "split", "--global-batch", "3"),
        "needs the global batch (3) divisible by every world size",
        pytest=True,
    ),
    Case(
        "conflicting pair: micro-batches that do not divide the local batch",
        ("--world-sizes", "1,2", "--data-modes", "split", "--features", "accum", "--global-batch", "6"),
        "--features accum splits each rank's batch into 2 micro-batches; at world size(s) [2]",
        pytest=True,
    ),
    Case(
        "conflicting pair: hybrid sharding at an odd world size",
        ("--world-sizes", "1,3", "--features", "hsdp"),
        "--features hsdp runs 2 replicas of W/2 ranks each, so a world size above 1 must divide by 2; [3]",
        pytest=True,
    ),
    Case(
        "a baseline that is not there",
        ("--baseline", "no_such_baseline"),
        "no reports/baselines/no_such_baseline/*.json (relative to the current directory, <checkout>)",
        pytest=True,
    ),
    Case(
        "conflicting pair: --gate without --baseline", ("--gate", "loss:1e-7"), "--gate needs --baseline", pytest=True
    ),
    Case(
        "conflicting pair: --gate-strict without --baseline",
        ("--gate-strict",),
        "--gate-strict needs --baseline",
        pytest=True,
    ),
    Case(
        "a list option given twice",
        ("--models", "mlp", "--models", "tinylm"),
        "--models is given more than once: it takes one comma-separated list (--models a,b)",
        pytest=True,
    ),
    Case(
        "a value option given twice",
        ("--lr", "1e-2", "--lr=1e-3"),
        "--lr is given more than once: it takes one value",
        pytest=True,
    ),
    # the other verbs: the same parsers, checks and limits as run (harness.preflight.checked_scenario)
    Case("localize: not a scenario id", ("garbage",), "'garbage' is not a scenario id", verb="localize"),
    Case(
        "localize: unknown implementation",
        ("fsdp_imp-mlp-ws2-split-adamw",),
        "implementation: unknown adapter 'fsdp_imp'",
        verb="localize",
    ),
    Case(
        "localize: adapter module that is not there (no PYTHONPATH)",
        ("no_such_pkg.adapters.Mine-mlp-ws2-split-adamw",),
        "module 'no_such_pkg.adapters' could not be imported",
        verb="localize",
    ),
    Case(
        "localize: unknown model",
        ("fsdp_impl-resnet-ws2-split-adamw",),
        "model: unknown 'resnet'; choose from",
        verb="localize",
    ),
    Case(
        "localize: split data at a world size that does not divide the batch",
        ("fsdp_impl-mlp-ws3-split-adamw",),
        "--data-modes split needs the global batch (16) divisible by every world size; [3]",
        verb="localize",
    ),
    Case(
        "localize: more ranks than the machine's memory holds",
        ("fsdp_impl-mlp-ws100000-replicated-adamw",),
        "ranks fit this machine's memory",
        varies=True,
        verb="localize",
    ),
    Case(
        "localize: the reference itself",
        ("reference-mlp-ws1-replicated-adamw",),
        "is the plain reference itself",
        verb="localize",
    ),
    Case(
        "localize: traced steps beyond the run",
        ("fsdp_impl-mlp-ws2-split-adamw", "--steps", "3", "--up-to", "5"),
        "--up-to 5: the run has 3 steps",
        verb="localize",
    ),
    Case(
        "plan: a world size above the model's largest dim 0",
        ("--model", "mlp", "--world-sizes", "1,64"),
        "above 37 ranks (mlp's largest dim 0)",
        verb="plan",
    ),
    Case(
        "plan: an implementation the planner cannot plan",
        ("--model", "mlp", "--impl", "ddp", "--world-sizes", "2"),
        "--impl ddp: the planner cannot plan it",
        verb="plan",
    ),
    Case(
        "plan: an option given twice",
        ("--model", "mlp", "--model", "tinylm"),
        "--model is given more than once: it takes one comma-separated list",
        verb="plan",
    ),
    Case("report: no stored run there", ("{tmp}/no_run",), "no saved run at", verb="report"),
    Case("compare: no stored run there", ("{tmp}/no_run", "default"), "no saved run at", verb="compare"),
)


@dataclass
class Outcome:
    case: Case
    mode: str  # "cli" | "pytest"
    rc: int | None  # None: it did not finish in time
    lines: list[str]  # the error lines found
    traceback: bool
    output: str

    @property
    def line(self) -> str:
        return self.lines[0] if len(self.lines) == 1 else " / ".join(self.lines) or "(no error line)"


_ERROR_LINE = re.compile(r"(^|: )error: |^ERROR: (?!usage:)")


def error_lines(output: str) -> list[str]:
    """The lines that state an error: argparse's ``prog: error: ...``, the CLI's ``error: ...``,
    pytest's ``ERROR: ...`` (not its ``ERROR: usage: ...`` banner)."""
    return [line.strip() for line in output.splitlines() if _ERROR_LINE.search(line.strip())]


def command(case: Case, mode: str, tmp: Path) -> list[str]:
    """The bad options first (argparse converts in order: a bad value fails before the valid
    ``--impl`` imports torch), then the tiny matrix's options that the case does not set."""
    args = [a.replace("{tmp}", str(tmp)) for a in case.args]
    if case.verb != "run":
        return [sys.executable, "-m", "harness", case.verb, *args]
    rest = [*TINY, "--report", str(tmp / "report.md")]
    pairs = [rest[i : i + 2] for i in range(0, len(rest), 2)]
    rest = [tok for pair in pairs if pair[0] not in case.args for tok in pair]
    if mode == "cli":
        return [sys.executable, "-m", "harness", "run", *args, *rest, "--quiet"]
    return [
        sys.executable,
        "-m",
        "pytest",
        "suites/harness/end_to_end/test_equivalence.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        *args,
        *rest,
    ]


def _pythonpath(tmp: str) -> str:
    return os.pathsep.join(filter(None, [str(ROOT), tmp, os.environ.get("PYTHONPATH")]))


@contextlib.contextmanager
def _probe_dir():
    """The probe's temp dir: a regular file for the report-path cases, the module that raises on import."""
    with tempfile.TemporaryDirectory(prefix="bad-input-") as tmp:
        (Path(tmp) / "a_file").write_text("a regular file, not a directory\n")
        (Path(tmp) / f"{BROKEN_MODULE}.py").write_text('raise RuntimeError("broken on purpose")\n')
        yield tmp


def _outcome(case: Case, mode: str, rc: int | None, output: str, tmp: str) -> Outcome:
    output = output.replace(tmp, "<tmp>").replace(str(ROOT), "<checkout>")  # the same table from any checkout
    return Outcome(case, mode, rc, error_lines(output), "Traceback (most recent call last)" in output, output)


def probe(case: Case, mode: str, timeout_s: float = 180.0) -> Outcome:
    """The case in a fresh process."""
    with _probe_dir() as tmp:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": _pythonpath(tmp),
            **{k: v.replace("{tmp}", tmp) for k, v in case.env},
        }
        try:
            proc = subprocess.run(
                command(case, mode, Path(tmp)), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = None
            output = f"{exc.stdout or ''}{exc.stderr or ''}"
        return _outcome(case, mode, rc, output, tmp)


def probe_forked(jobs: list[tuple[Case, str]], workers: int, timeout_s: float = 180.0) -> list[Outcome]:
    """The cases, each in a fork of one process that imported torch once (suites/faults/warm_cli.py):
    the same entry point, argv, PYTHONPATH and output as ``probe``'s fresh process, without its
    2 seconds of importing torch. Only for cases that set no environment variable."""
    assert not any(case.env for case, _ in jobs), "a case that sets the environment needs a fresh process"
    with contextlib.ExitStack() as stack:
        outs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bad-input-out-")))
        tmps = [stack.enter_context(_probe_dir()) for _ in jobs]
        specs = []
        for i, ((case, mode), tmp) in enumerate(zip(jobs, tmps)):
            _python, _m, module, *args = command(case, mode, Path(tmp))
            specs.append(
                {
                    "module": module,
                    "args": args,
                    "pythonpath": _pythonpath(tmp),
                    "stdout": str(outs / f"{i}.out"),
                    "stderr": str(outs / f"{i}.err"),
                }
            )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath("")}
        codes = warm_cli.run(specs, env, ROOT, workers, timeout_s)
        return [
            _outcome(case, mode, rc, _read(spec["stdout"]) + _read(spec["stderr"]), tmp)
            for (case, mode), tmp, spec, rc in zip(jobs, tmps, specs, codes)
        ]


def _read(path: str) -> str:
    """As subprocess's text mode reads a pipe: the locale's encoding, universal newlines."""
    with open(path) as f:
        return f.read()


def probe_all(cases=CASES, workers: int = 3) -> list[Outcome]:
    """Every case, in the CLI and (where marked) through pytest; a case that sets environment
    variables in a fresh process (modules read some at import), every other one forked."""
    jobs = [(c, "cli") for c in cases] + [(c, "pytest") for c in cases if c.pytest]
    fresh = [job for job in jobs if job[0].env]
    forked = [job for job in jobs if not job[0].env]
    with ThreadPoolExecutor(workers) as pool:
        fresh_outcomes = pool.map(lambda job: probe(*job), fresh)
        got = dict(zip(forked, probe_forked(forked, workers)))
        got.update(zip(fresh, fresh_outcomes))
    return [got[job] for job in jobs]
