"""The table schema: every table a run produces, what one row is, and its columns in order.

The one definition that building (`build.py`), storing (`store.py`), the test builders and the table of
tables in docs/report.md all read; a test holds the page to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.core.verdict import VERDICT_COLUMNS


@dataclass(frozen=True)
class Table:
    name: str
    row: str  # what one row is
    columns: tuple[str, ...]  # every column, in order
    note: str = ""  # what the docs' table adds after the columns
    # the columns a stored run must have to be read back; the others may be missing from a run
    # stored before they existed, and the checks that need them fail by name (checks/numeric.py)
    required: tuple[str, ...] | None = None  # None: all of them

    @property
    def required_columns(self) -> tuple[str, ...]:
        return self.columns if self.required is None else self.required


# What the less obvious columns hold:
#   scenarios   sharded_state: the training state the implementation partitions over its ranks, comma-separated
#               (params,grads,optimizer_state for ZeRO-3; optimizer_state alone for ZeRO-1; '' for DDP), what
#               the memory and traffic ideals divide; engine_clips: the implementation drives its own step and
#               clips inside it, so the gradient norm recorded is the one it applied (after clipping)
#   steps       clip_norm (clip features): the global gradient norm before clipping, as the adapter's
#               clip_grad_norm returned it (NaN otherwise); where the implementation clips inside its own step
#               (scenarios.engine_clips), the norm of the gradient it applied, after clipping, in the clip's norm; grad_diff_ws1 (replicated data, W > 1): max |difference| between the sorted non-zero
#               gradient values the optimizers applied at that step, over all ranks, and those at
#               world size 1 (0: bitwise the same values; inf: a different count)
#               max_diff_factor (split data, accum / no_sync at W): max |param diff| vs the same
#               implementation's plain step at W x k ranks (the same micro-batches), worst_param_factor where
#               reports_differ: what ranks > 0 recorded for the step (loss, the norm clip_grad_norm returned,
#               the eval loss) that differs from rank 0's, 'rank:field=value' comma-separated ('' when every rank agrees)
#               eval_loss (feature eval): the loss of the no_grad forward on the step's held-out batch, after
#               the optimizer step (NaN otherwise); eval_loss_plain: the plain model's eval loss at the parameters
#               the step left (the run's snapshot, harness/train/plain_eval.py), on the held-out batch cut as the
#               run cut it (NaN without eval, and at a resumed run's steps that its saver trained)
#               reduction_ranks (replicated data, W > 1, not hsdp): the ranks whose inputs to the step's
#               gradient reductions (hashed as the rank issued them) differ from the other ranks', comma-separated
#               ('' when all agree)
#               replicas_differ (hsdp, W > 2): ranks whose own parameter parts differ bit for bit from the
#               first replica's rank with the same index after the step (0 when the replicas agree)
#               jitter_delays, jitter_s (jitter): the delays injected in the step and their seconds, summed
#               over the ranks (0 without jitter)
#               nonfinite_module: at the first step whose loss is not finite, the plain model's module whose
#               forward output was first non-finite at the parameters the run had before it, '(loss)' where
#               only the loss was, '(not reproduced by the plain model)' where neither was
#               (harness/train/nonfinite.py); '' at every other step
#               max_diff_probe (split data at W): max |param diff| vs the noise probe at W, the plain model
#               summing the W ranks' micro-batches in rank order (Scenario.rank_order_probe), worst_param_probe
#               where
#   params      the full, unsharded parameter under its module path; diff_probe: vs the noise probe in rank
#               order (Scenario.rank_order_probe: a split run's at its W, a reversed probe's twin); diff_factor
#               (split data, accum / no_sync): vs the same implementation's plain step at W x k ranks;
#               travel (the plain model's runs only): ||the parameter's step||_F, what the step moved it
#   scenarios   global_batch: samples per step over all ranks (optional when reading: a run stored
#               before it was recorded has none); backend: gloo or nccl (optional when reading: gloo);
#               failed_rank: the rank a failure started on;
#               param_bytes: the full parameters;
#               largest_unit_bytes: the largest unit's full parameters; row_bytes: one dim-0 row of
#               every parameter tensor, summed; param_tensors: their count; params_compared: the
#               plain model's parameters whose names and shapes were held against full_params; rows_compared:
#               the dim-0 rows whose moving was held against the reference's (harness/tables/rows.py),
#               rows_moved: how many of them the reference moved; rows_noise: how many rows the run moved
#               otherwise than the reference that were left unheld, moved by no more than 2 x their
#               parameter's noise floor (the plain model itself moves them or not as the batch is cut) or
#               than rounding alone moves an element (policy [Note: rows at rounding level]); params_moved: how
#               many parameters the run itself moved over its steps further than rounding alone moves an element
#               (harness/tables/rows.py params_moved: 0, it trained nothing);
#               buffer_bytes: the plain model's buffers; batch_stats: the plain model's layers that
#               normalise with batch statistics (BatchNorm), comma-separated; weighted_loss: the model's loss is
#               a mean weighted by a count each sample carries (a token mean: harness/train/user_models.py
#               weighted_loss), so split data averages the ranks' own means; restore_diff (ckpt, resumed
#               runs): max |difference|
#               between the parameters right after loading and the saver's at that step, restore_param
#               where it is; state_restore_diff: the same for the optimizer state every rank holds (inf:
#               a value or rows missing or extra), state_restore_param / _rank / _where the worst
#               element (state key, element, both values) or what is missing, state_restored what was
#               compared (harness.tables.restored_state); calm_step, calm_param, calm_element (jitter): the
#               first step, parameter and element (with both values) where the run's parameters differ bit
#               for bit from its calm twin's (the same run without jitter; calm_step NaN: nowhere),
#               calm_compared the steps whose parameters were compared; state_bytes: max over ranks of params +
#               grads + optimizer state held after the measured step (harness.measure.census, which
#               also records buffers and other apart); peak_bytes: max over ranks
#   memory      bytes on that rank: the peak by category during the measured step, and the state
#               held after it (state_*)
#   comm        rank 0, per training step averaged over the steps (harness.measure.comm)
SCENARIO_IDS = ("scenario", "impl", "model", "world_size", "data_mode", "optimizer", "seed")
# after the ids; optional when reading: a run stored before features existed is plain, trained from scratch,
# one micro-batch per step (micro_batches: Scenario.micro_batches, > 1 only for a reference; reverse_micro:
# a noise probe's micro-batches in reverse rank order; nudge: a noise probe's clipping coefficient moved by
# that many ulps)
FEATURE = ("feature", "resume_from", "micro_batches", "reverse_micro", "nudge")

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            "steps",
            "scenario x step",
            SCENARIO_IDS
            + FEATURE
            + (
                "step",
                "loss",
                "grad_norm",
                "max_diff_ref",
                "worst_param_ref",
                "max_diff_ws1",
                "worst_param_ws1",
                "grad_diff_ws1",
                "clip_norm",
                "max_diff_factor",
                "worst_param_factor",
                "replicas_differ",
                "max_diff_probe",
                "worst_param_probe",
                "reduction_ranks",
                "reports_differ",
                "eval_loss",
                "eval_loss_plain",
                "jitter_delays",
                "jitter_s",
                "nonfinite_module",
            ),
            required=SCENARIO_IDS
            + ("step", "loss", "grad_norm", "max_diff_ref", "worst_param_ref", "max_diff_ws1", "worst_param_ws1"),
        ),
        Table(
            "params",
            "scenario x step x parameter",
            (
                "scenario",
                "step",
                "param",
                "numel",
                "diff_ref",
                "diff_ws1",
                "sum",
                "diff_probe",
                "diff_factor",
                "travel",
            ),
            required=("scenario", "step", "param", "numel", "diff_ref", "diff_ws1", "sum"),
        ),
        Table(
            "scenarios",
            "scenario",
            SCENARIO_IDS
            + FEATURE
            + (
                "steps",
                "lr",
                "global_batch",
                "backend",
                "status",
                "error",
                "failed_rank",
                "final_loss",
                "param_sum",
                "max_diff_ref",
                "max_diff_ws1",
                "sharded",
                "sharded_state",
                "engine_clips",
                "param_bytes",
                "trainable_bytes",
                "param_elements",
                "trainable_elements",
                "largest_unit_bytes",
                "largest_child_bytes",
                "root_bytes",
                "row_bytes",
                "param_tensors",
                "buffer_bytes",
                "batch_stats",
                "weighted_loss",
                "params_compared",
                "rows_compared",
                "rows_moved",
                "rows_noise",
                "params_moved",
                "restore_diff",
                "restore_param",
                "state_restore_diff",
                "state_restore_param",
                "state_restore_rank",
                "state_restore_where",
                "state_restored",
                "calm_step",
                "calm_param",
                "calm_element",
                "calm_compared",
                "state_bytes",
                "peak_bytes",
                "step_time_s",
            ),
            required=SCENARIO_IDS
            + (
                "steps",
                "lr",
                "status",
                "error",
                "final_loss",
                "param_sum",
                "max_diff_ref",
                "max_diff_ws1",
                "state_bytes",
                "peak_bytes",
                "step_time_s",
            ),
        ),
        Table(
            "memory",
            "scenario x rank x category",
            ("scenario", "rank", "category", "bytes"),
            "category: params, grads, optimizer_state, activations, other, peak; state_params, state_grads, "
            "state_optimizer_state, state_buffers, state_other, state_unattributed (CUDA), state_total",
        ),
        Table(
            "gathered",
            "scenario x rank x phase of the measured step",
            ("scenario", "rank", "phase", "moments", "units", "which", "root", "params"),
            "units: the most units (the root aside) holding their full parameters at one moment of the phase, "
            "which: their names, root: the root's own parameters full at some moment, params: some parameter "
            "full at some moment (harness.measure.timeline)",
            required=("scenario", "rank", "phase", "moments", "units", "which", "root"),
        ),
        Table(
            "comm",
            "scenario x collective x element type x group size",
            ("scenario", "collective", "dtype", "ranks", "calls", "elements", "bytes"),
            "per step, the full size each collective handles, from every thread of the rank; ranks: of the group "
            "it ran over (0: unknown)",
            required=("scenario", "collective", "dtype", "calls", "elements", "bytes"),
        ),
        Table(
            "coverage",
            "scenario x step x parameter `full_params` got wrong",
            ("scenario", "step", "param", "problem"),
            "problem: missing, not a parameter of the plain model, another shape; empty when all held",
        ),
        Table(
            "rank_diffs",
            "scenario x step x parameter x rank, where the parameter differs at all",
            ("scenario", "step", "param", "rank", "diff_ref", "diff_ws1"),
            "max |param diff| within the dim-0 rows that rank holds (DTensor parameters laid out by rows), vs the "
            "reference and vs world size 1: which ranks' rows parted",
            required=(),
        ),
        Table(
            "rows_trained",
            "scenario x parameter whose moved rows differ from its reference's",
            ("scenario", "param", "step", "still", "extra", "ranks"),
            "rows (dim-0 indices) that moved from the run's starting snapshot by its last step, held against the "
            "reference's: still, moved by the reference only (never trained); extra, moved by the run only; "
            "step, the first step one of them moved; ranks, those holding them; empty when every run moved the "
            "rows its reference moved (harness/tables/rows.py)",
            required=(),
        ),
        Table(
            "verdicts",
            "verdict",
            tuple(VERDICT_COLUMNS),
            required=("check", "scenario", "status", "measured", "bound", "where", "message", "step", "param"),
        ),
        Table(
            "localised",
            "failing scenario localised (the first --localize N)",
            (
                "scenario",
                "yardstick",
                "steps",
                "step",
                "micro_batch",
                "phase",
                "module",
                "op",
                "ranks",
                "element",
                "rounding",
                "context",
            ),
            "where the scenario first parted from its yardstick (harness.localize); element: the parameter or op "
            "output element with both values; context: the yardstick's ops of that module around it",
            required=(),
        ),
        Table(
            "per_sample",
            "model x impl x data mode x world size x sample",
            ("model", "impl", "data_mode", "world_size", "sample", "norm", "truth"),
            "with `--per-sample`",
        ),
        Table(
            "per_sample_summary",
            "model x impl x data mode x world size",
            (
                "model",
                "impl",
                "data_mode",
                "world_size",
                "mean_norm",
                "truth_mean",
                "ratio_of_means",
                "max_rel_err",
                "clipped_update_rel_err",
                "update_ratio",
            ),
            "with `--per-sample`",
        ),
    )
}


def columns(name: str) -> list[str]:
    """The columns of table `name`, in order."""
    return list(TABLES[name].columns)


def docs_table() -> str:
    """docs/report.md's table of tables (markdown), made from the schema."""
    lines = ["| table | one row per | columns |", "|---|---|---|"]
    for t in TABLES.values():
        cols = ", ".join(t.columns) + (f" ({t.note})" if t.note else "")
        lines.append(f"| `{t.name}` | {t.row} | {cols} |")
    return "\n".join(lines)
