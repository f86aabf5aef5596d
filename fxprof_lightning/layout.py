"""Every name the package gives to what it writes: directories, files and TensorBoard tags (no torch import).

A run's directory (``dirpath``, default ``./fxprof``; with Lightning ``<log_dir>/fxprof``) holds one directory per
cycle, ``cycle_NNNN`` (validation: ``val_cycle_NNNN``; ``-pN`` for the N-th piece of a cycle cut short, ``-rN``
when an earlier run in the same directory took the name), each with the traces (``rank<r>.<ns>.pt.trace.json.gz``)
and the files below. Tags: the run's totals under ``fxprof/``, the whole step under ``fxprof_step/``, the tracked
nodes under ``fxprof_nodes/`` (validation: ``fxprof_val/``, ``fxprof_val_nodes/``).
"""

from __future__ import annotations

__all__ = ["CYCLE_PREFIXES", "DEFAULT_DIRPATH", "HTML_FILE", "LOOP_PHASES", "MODULES_FILE", "NODES_FILE", "PHASES",
           "PICTURE_FILES", "RANGES_FILE", "STEP_FILE", "SUMMARY_FILE", "SUMMARY_FILES", "TREND_FILE", "TREND_TAG",
           "stage_tag"]

DEFAULT_DIRPATH = "fxprof"  # relative to the working directory, as torch.utils.tensorboard's "runs"
CYCLE_PREFIXES = {"train": "cycle_", "val": "val_cycle_"}  # stage -> cycle directory prefix

# The phases of a whole step (``step_phases``; tags ``fxprof_step/<phase>``, rows of ``fx_step.csv``), in order.
PHASES = ("data", "training_step", "zero_grad", "backward", "optimizer", "callbacks", "fxprof", "other")
LOOP_PHASES = ("forward", "backward", "fxprof", "other")  # a plain loop's (``loop_phases.LoopClock``)

NODES_FILE = "fx_nodes.csv"  # the node table (report.nodes_csv)
MODULES_FILE = "fx_modules.csv"  # the module tree (report.modules_csv)
RANGES_FILE = "fsdp_ranges.csv"  # FSDP2's ranges (report.ranges_csv)
STEP_FILE = "fx_step.csv"  # the step's phases and the time no row owns (report.step_csv)
# The rest of the report as one JSON line (CycleReport.to_summary): not ``.json``, because HolisticTraceAnalysis
# reads every ``.json`` file of a directory as a trace. ``cycle.json`` is read too (older runs).
SUMMARY_FILE = "cycle.jsonl"
SUMMARY_FILES = (SUMMARY_FILE, "cycle.json")
PICTURE_FILES = {"slowest_layers": "slowest_layers.png", "module_tree": "module_tree.png"}  # per cycle, by tag name
TREND_FILE = "trend.png"  # at the end, in the run's last cycle directory
TREND_TAG = "fxprof/trend"
HTML_FILE = "fxprof_report.html"  # ``fxprof report RUN --html``: the page's default place, in RUN


def stage_tag(stage: str) -> str:
    """``fxprof`` for training cycles, ``fxprof_val`` for validation cycles (``..._nodes`` for the node series)."""
    return "fxprof_val" if stage == "val" else "fxprof"
