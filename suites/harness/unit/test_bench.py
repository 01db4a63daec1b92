"""The benchmarks end to end. harness/bench/fsdp_vs_fsdp2.py: two small models at W = 1, 2, one measured
step; the printed tables must have every row and column, positive figures and finite ratios that agree
with them. harness/bench/harness_cost.py: a row per world size and the sums, both figures positive."""

from __future__ import annotations

import math
import os
import re

import pytest

from harness.bench import fsdp_vs_fsdp2 as bench

# the CI tier (--ci; .ci/run runs it): the benchmarks' command lines end to end
pytestmark = pytest.mark.ci

MODELS = ("mlp", "tinylm")
WORLD_SIZES = (1, 2)
VARIANTS = tuple(label for label in bench.IMPLS if label != bench.FSDP2)
ARGV = [
    "--world-sizes",
    ",".join(map(str, WORLD_SIZES)),
    "--model",
    ",".join(MODELS),
    "--steps",
    "1",
    "--warmup",
    "1",
    "--global-batch",
    "4",
]


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def check_output(text: str, models=MODELS, world_sizes=WORLD_SIZES) -> dict[str, dict[tuple[int, str], list[str]]]:
    """Asserts the benchmark's printed output is complete and sane; returns {model: {(W, variant): cells}}."""
    assert re.search(r"^# machine: .+\(\w+\), \d+ CPUs usable, torch \S+", text, re.M), "no machine line"
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.split(":", 1)[0] for s in sections] == list(models), "one table per model, in order"
    out = {}
    for model, section in zip(models, sections):
        n = re.match(rf"{re.escape(model)}: ([\d,]+) parameters\n", section)
        assert n and _number(n.group(1)) > 0, f"{model}: no parameter count"
        lines = [ln for ln in section.splitlines() if ln.startswith("|")]
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        assert head == list(bench.COLUMNS), f"{model}: columns {head}"
        assert set(lines[1]) <= {"|", "-"}
        rows = {}
        for ln in lines[2:]:
            cells = [c.strip() for c in ln.strip("|").split("|")]
            assert len(cells) == len(head), f"{model}: row {cells}"
            rows[(int(cells[0]), cells[1])] = cells
        assert len(rows) == len(lines) - 2, f"{model}: a repeated row"
        assert sorted(rows) == sorted((w, v) for w in world_sizes for v in VARIANTS), f"{model}: rows {sorted(rows)}"
        for key, cells in rows.items():
            lo, hi = (_number(c) for c in cells[5].split("-"))
            mine_ms, ref_ms, r_ms, r_cpu, mine_peak, ref_peak, r_peak = map(_number, cells[2:5] + cells[6:])
            for x in (mine_ms, ref_ms, r_ms, lo, hi, r_cpu, mine_peak, ref_peak, r_peak):
                assert math.isfinite(x) and x > 0, f"{model} {key}: {cells}"
            # the times are printed to 0.01 ms, every ratio to 0.01: what rounding can account for, no more
            slack = 0.0051 + mine_ms / ref_ms * (0.0051 / mine_ms + 0.0051 / ref_ms)
            assert r_ms == pytest.approx(mine_ms / ref_ms, abs=slack), f"{model} {key}: time ratio {cells}"
            # every step_i / ref_step_i in [lo, hi] bounds the ratio of the medians too
            assert lo - 0.011 <= r_ms <= hi + 0.011, f"{model} {key}: time ratio outside the per-step range {cells}"
            assert r_peak == pytest.approx(mine_peak / ref_peak, abs=0.006), f"{model} {key}: peak ratio {cells}"
        out[model] = rows
    return out


def test_benchmark_prints_one_complete_table_per_model(capsys):
    results = bench.main(ARGV)
    text = capsys.readouterr().out
    tables = check_output(text)
    # the returned figures are the printed ones; every implementation trained (finite, equal losses at W=1)
    assert list(results) == list(MODELS)
    for model in MODELS:
        assert list(results[model]) == list(WORLD_SIZES)
        for w in WORLD_SIZES:
            res = results[model][w]
            assert set(res) == set(bench.IMPLS)
            assert all(math.isfinite(v["final_loss"]) for v in res.values())
            for variant in VARIANTS:
                assert tables[model][(w, variant)][2] == f"{res[variant]['ms']:.2f}"
                assert (
                    _number(tables[model][(w, variant)][bench.COLUMNS.index("fsdp2 peak bytes")])
                    == res[bench.FSDP2]["peak"]
                )


GOOD = """# machine: Some CPU (AVX2), 2 CPUs usable, torch 2.0, python 3.11

## mlp: 1,000 parameters

| world size | variant | variant step ms | fsdp2 step ms | ratio | per-step ratios | cpu ratio | variant peak bytes \
| fsdp2 peak bytes | ratio |
|---|---|---|---|---|---|---|---|---|---|
| 1 | fsdp_impl | 2.00 | 4.00 | 0.50 | 0.40-0.60 | 0.70 | 100 | 200 | 0.50 |
| 1 | fsdp_impl[reduce fp32] | 2.00 | 4.00 | 0.50 | 0.40-0.60 | 0.70 | 100 | 200 | 0.50 |
| 1 | fsdp_impl[invariant] | 3.00 | 4.00 | 0.75 | 0.60-0.90 | 0.70 | 100 | 200 | 0.50 |
| 2 | fsdp_impl | 2.00 | 4.00 | 0.50 | 0.40-0.60 | 0.70 | 100 | 200 | 0.50 |
| 2 | fsdp_impl[reduce fp32] | 2.00 | 4.00 | 0.50 | 0.40-0.60 | 0.70 | 100 | 200 | 0.50 |
| 2 | fsdp_impl[invariant] | 3.00 | 4.00 | 0.75 | 0.60-0.90 | 0.70 | 100 | 200 | 0.50 |
"""


@pytest.mark.parametrize(
    "broken",
    [
        lambda t: t.replace(
            "| 2 | fsdp_impl[reduce fp32] | 2.00 | 4.00 | 0.50 | 0.40-0.60 | 0.70 | 100 | 200 | 0.50 |\n", ""
        ),  # a row gone
        lambda t: t.replace("| 1 | fsdp_impl | 2.00 | 4.00 | 0.50 |", "| 1 | fsdp_impl | 2.00 | 0.00 | inf |"),
        lambda t: t.replace("| 2 | fsdp_impl | 2.00 | 4.00 | 0.50 |", "| 2 | fsdp_impl | 2.00 | 4.00 | nan |"),
        lambda t: t.replace("| 1 | fsdp_impl | 2.00 | 4.00 | 0.50 |", "| 1 | fsdp_impl | 2.00 | 4.00 | 0.70 |"),
        lambda t: t.replace(" | fsdp2 peak bytes", ""),  # a column gone
        lambda t: t.replace("| 0.40-0.60 | 0.70 | 100 |", "| 0.52-0.60 | 0.70 | 100 |", 1),  # ratio outside the range
        lambda t: t.replace("| 0.40-0.60 | 0.70 | 100 |", "| 0.40-0.60 | inf | 100 |", 1),
        lambda t: t.replace("# machine:", "#"),
        lambda t: t.replace("## mlp: 1,000 parameters", "## mlp"),
    ],
)
def test_the_output_check_can_fail(broken):
    """check_output accepts a well-formed table and rejects each kind of damage to it."""
    check_output(GOOD, models=("mlp",))
    with pytest.raises(AssertionError):
        check_output(broken(GOOD), models=("mlp",))


def test_harness_cost_prints_bare_and_harnessed_seconds_per_world_size_and_where_the_run_went(tmp_path):
    """python -m harness.bench.harness_cost on one tiny cell per world size: a row per W with both figures and
    their ratio, the whole run against the bare sum, the first progress line of a real launch, and the run's
    seconds by part, the bare training first, every part the ranks and phases record among them."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.bench.harness_cost",
            "--world-sizes",
            "1,2",
            "--impl",
            "fsdp_impl",
            "--models",
            "mlp",
            "--optimizers",
            "sgd",
            "--steps",
            "2",
            "--no-plots",
            "--report",
            str(tmp_path / "run.md"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {
        line.split()[0]: line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["all"])
    }
    assert set(rows) == {"1", "2", "all"}, out.stdout
    for row in rows.values():
        runs, bare, harnessed, ratio = int(row[1]), float(row[2]), float(row[3]), float(row[4].rstrip("x"))
        assert runs > 0 and bare > 0 and harnessed > 0, out.stdout
        # the seconds are printed to 3 decimals, the ratio to 2: its error from the rounding of a small floor
        assert ratio == pytest.approx(harnessed / bare, abs=0.006 + harnessed / bare * 0.0006 / bare), out.stdout
    assert int(rows["all"][1]) == int(rows["1"][1]) + int(rows["2"][1])
    # each size's world start is its own column, out of the ratio (a bare training runs in a world already started)
    assert float(rows["1"][5]) > 0 and float(rows["2"][5]) > 0, out.stdout
    whole = re.search(r"the whole run: ([\d.]+) s wall against ([\d.]+) s of bare training: ([\d.]+)x", out.stdout)
    assert whole, out.stdout
    assert float(whole[2]) == pytest.approx(float(rows["all"][2]), abs=0.002)
    assert float(whole[3]) == pytest.approx(float(whole[1]) / float(whole[2]), rel=0.01, abs=0.01)
    first = re.search(r"first progress line ([\d.]+) s after", out.stdout)
    assert first and 0 < float(first[1]) < float(whole[1]) + 60, out.stdout
    said = re.search(r"first line ([\d.]+) s after launch: running \d+ scenarios", out.stdout)
    assert said and 0 < float(said[1]) <= float(first[1]), out.stdout
    if os.path.exists("/proc/stat"):  # the machine over each part: idle and stolen core-seconds
        machine = re.findall(
            r"(the run and its bare training) ([\d.]+) s: ([\d.]+) of ([\d.]+) core-seconds idle, ([\d.]+) stolen",
            out.stdout,
        )
        assert [m[0] for m in machine] == ["the run and its bare training"], out.stdout
        for _, wall_s, idle, total, steal in machine:
            assert 0 < float(wall_s) and 0 < float(total) and float(idle) + float(steal) <= float(total) + 0.05, (
                out.stdout
            )
    table = out.stdout.split("where the run went", 1)[1].splitlines()[1:]
    parts = {line[:66].strip(): float(line[66:].split()[0]) for line in table if line.strip()}
    assert list(parts)[0] == "bare training (the floor)"
    assert parts["bare training (the floor)"] == pytest.approx(float(whole[2]), abs=0.002)
    for part in (
        "world starts",
        "full-parameter snapshots (initial and every step)",
        "the parent's tables",
        "the parent's checks",
        "the report and tables written",
    ):
        assert parts[part] > 0, (part, out.stdout)
    assert sum(parts.values()) == pytest.approx(float(whole[1]), abs=0.05), out.stdout


def test_harness_cost_trains_each_run_bare_in_its_world_after_it_and_never_beside_a_run():
    """PairedPool: every run of the matrix that ran gets its bare training, after its own call of the harness's task
    ended, and no bare training overlaps any call of that task (one side by side with a run would time both on
    shared cores). Worlds of 1, 2 and 4: on most machines at least one size runs side by side (its bare training
    after the last of its size) and one at a time (right after each run)."""
    from harness.bench.harness_cost import PairedPool, parse_args
    from harness.session import Session, session_options

    ns, _ = parse_args(
        "--world-sizes 1,2,4 --impl fsdp_impl --models mlp --optimizers sgd --steps 2 --no-report".split()
    )
    session = Session(session_options(ns))
    with PairedPool(session.scenarios(), timeout_s=120) as pool:
        res = session.run(worlds=pool)
        pool.pair_the_rest()
    ran = {sc.id for sc in res.scenarios if "ranks" in res.records[sc.id]}
    assert ran and set(pool.bare) == ran, (ran, pool.bare)
    assert all(v["steps"] > 0 and v["setup"] > 0 for v in pool.bare.values())
    assert sorted(i for i, _, _ in pool.intervals) == sorted(ran)  # each once
    ended = {i: end for i, _, end in pool.calls}
    for i, start, end in pool.intervals:
        assert start >= ended[i], i
        for j, call_start, call_end in pool.calls:
            assert end <= call_start or call_end <= start, (i, j)
    spans = sorted((start, end) for _, start, end in pool.intervals)  # one at a time: their sum is wall time
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans


def test_measured_step_prints_each_way_against_the_plain_step(capsys):
    from harness.bench import measured_step

    measured_step.main(["--models", "mlp", "--repeats", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("mlp ")]
    assert len(rows) == 1
    # model, ops, then per way: fastest / median [ratio]
    _, ops, plain, _, _, empty, _, _, empty_ratio, peak, _, _, peak_ratio = rows[0]
    assert int(ops) > 0
    assert float(plain) > 0 and float(empty) > 0 and float(peak) > 0
    assert math.isclose(float(empty_ratio[:-1]), float(empty) / float(plain), rel_tol=0.02)
    assert math.isclose(float(peak_ratio[:-1]), float(peak) / float(plain), rel_tol=0.02)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads the machine's idle time from Linux's /proc/stat")
def test_idle_cores_prints_each_line_of_the_run_with_the_idle_core_seconds_before_it():
    """python -m harness.bench.idle_cores on a tiny run: every line the run printed, each with seconds since launch
    that never go back and idle core-seconds within the core-seconds of its interval, then the totals."""
    import subprocess
    import sys

    args = ["--world-sizes", "1", "--impl", "fsdp_impl", "--models", "mlp", "--optimizers", "sgd", "--steps", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "harness.bench.idle_cores", *args, "--no-report"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split(None, 4) for line in out.stdout.splitlines()[1:] if re.match(r"\s+[\d.]+ ", line)]
    said = [row[4] for row in rows]
    assert any(s.startswith("[") for s in said) and any(s.startswith("PASS") for s in said), out.stdout
    at = [float(row[0]) for row in rows]
    assert at == sorted(at), out.stdout
    for row in rows:
        assert 0 <= float(row[2]) <= float(row[3]) + 0.02, row
    total = re.search(r"([\d.]+) s wall; the machine idle ([\d.]+) of ([\d.]+) core-seconds", out.stdout)
    assert total and float(total[2]) <= float(total[3]) and float(total[1]) >= at[-1], out.stdout


def test_cpu_seconds_reads_idle_steal_and_total_from_proc_stat():
    """/proc/stat's first line: idle is idle + iowait, steal its eighth field, the total the first eight (guest
    time is inside user time already, not counted twice); each in seconds of the kernel's clock ticks."""
    from harness.bench.idle_cores import cpu_seconds

    hz = os.sysconf("SC_CLK_TCK")
    got = cpu_seconds("cpu  100 1 50 1000 10 2 5 40 7 3")
    assert got.idle == pytest.approx(1010 / hz)
    assert got.steal == pytest.approx(40 / hz)
    assert got.total == pytest.approx(1208 / hz)
    assert (got - cpu_seconds("cpu  0 0 0 10 0 0 0 4 0 0")).steal == pytest.approx(36 / hz)
