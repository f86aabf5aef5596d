"""The report's views: a cycle as Markdown (the text the loggers and the console show), its module tree as text, and
its tables as the CSV files of the cycle's directory (``layout``: ``fx_nodes.csv``, ``fx_modules.csv``,
``fsdp_ranges.csv``, ``fx_step.csv``). ``CycleReport.to_markdown`` and its kin call these."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, fields

from fxprof_lightning.analysis.trust import cpu_per_wall, step_spread, waited_share
from fxprof_lightning.outputs.formats import step_wall_ms
from fxprof_lightning.report import CycleReport, ModuleStats, NodeStats, RangeStats

__all__ = ["markdown", "memory_line", "modules_csv", "modules_text", "nodes_csv", "ranges_csv", "step_csv"]


def markdown(report: CycleReport, top_k: int | None = None) -> str:
    """The cycle as Markdown: header, node table (slowest first, ``top_k`` rows at most), trust line,
    regressions, advice and FSDP ranges."""
    shown = report.nodes if top_k is None else report.nodes[:top_k]
    steps = max(len(report.steps), 1)
    step_range = f"steps {report.steps[0]}-{report.steps[-1]}" if report.steps else "no recorded step"
    stage = "Validation cycle" if report.stage == "val" else "Cycle"
    over_ranks = f", mean over {report.ranks} ranks" if report.ranks > 1 else ""
    straggler = report.ranks > 1
    header = f"{stage} {report.label}{' (partial)' if report.partial else ''}, {step_range}"
    header += f" ({report.trigger})" if report.trigger != "schedule" else ""
    header += f": node rows summed, forward {report.forward_ms_per_step:.3f} ms"
    if report.backward_ms_per_step:
        header += f", backward {report.backward_ms_per_step:.3f} ms"
        if report.backward_wall_ms:
            header += f" ({report.backward_account()})"
    header += f" per step (mean) over {len(report.nodes)} nodes{over_ranks}"
    if report.capture is not None:
        header += f"; captured by {report.capture.describe()}"
        if report.capture.leaves or report.capture.method == "module_hooks":
            header += f"; {report.whole_share:.0f}% of node time in blocks timed whole"
    if report.device is not None:
        d = report.device
        header += (f". GPU time from the trace's {d['kernels']:.0f} kernels/memcpys/memsets ({d['device_ms']:.3f} ms): "
                   f"{d['in_nodes_ms']:.3f} ms launched by nodes, {d['outside_ms']:.3f} ms outside them")
        if d["unlaunched"] or d["orphan_flows"]:
            header += f", {d['unlaunched']:.0f} with no launch in the trace, {d['orphan_flows']:.0f} flows naming no launch"
    if report.peaks is not None:
        header += f". Roofline peaks: {report.peaks}"
    if report.dropped_steps or report.capture_s:
        header += f". Left out of the numbers: {report.dropped_text()}"
    grand = sum(n.total_ms + n.bwd_total_ms for n in report.nodes) or 1.0
    memory = any(n.saved_bytes is not None for n in report.nodes)
    lines = [
        header,
        "",
        "| layer | op | fwd ms/call | bwd ms/call | fwd+bwd ms/step | % of fwd+bwd | calls/step "
        "| fwd GFLOP/s | % of peak | bound | node |" + (" MB saved/step |" if memory else "")
        + (" slowest rank fwd ms/call | slowest rank |" if straggler else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|" + ("---:|" if memory else "")
        + ("---:|---:|" if straggler else ""),
    ]
    for n in shown:  # (the node's name: the key of its scalar series, and of the CSV's rows)
        row = (
            f"| {_md(n.layer or n.name)} | {n.op.removeprefix('call_')} | {n.mean_ms:.3f} | {n.bwd_mean_ms:.3f} "
            f"| {(n.total_ms + n.bwd_total_ms) / steps:.3f} | {100 * (n.total_ms + n.bwd_total_ms) / grand:.1f} "
            f"| {n.calls / steps:g} | {_num(n.fwd_gflops_per_s, '.1f')} | {_num(n.pct_of_peak, '.0f')} | {n.bound} "
            f"| {_md(n.name)} |" + (f" {_mb(n.saved_bytes, n.calls / steps)} |" if memory else "")
        )
        if straggler:
            row += f" {n.slowest_rank_ms:.3f} | {n.slowest_rank} |"
        lines.append(row)
    if len(shown) < len(report.nodes):
        lines.append(f"\n{len(report.nodes) - len(shown)} faster nodes not shown (the CSV has every node, with its target).")
    lines.append("")
    held = memory_line(report)
    if held:
        lines += [held, ""]
    if report.checkpoint_plan is not None:
        lines += [f"Checkpointing plan (predicted from the saved bytes and forward times): {report.checkpoint_plan.text()}.",
                  ""]
    unowned = report.unowned()
    if unowned:
        measured = [f"{side} {wall:.3f} ms" for side, wall in (("forward", report.forward_wall_ms),
                                                               ("backward", report.backward_wall_ms)) if wall]
        lines += [f"Time no row owns, ms per step (with the rows: the measured {' and '.join(measured)}):", "",
                  "| where | fwd ms/step | bwd ms/step |", "|---|---:|---:|"]
        lines += [f"| {name} | {_num(fwd, '.3f')} | {_num(bwd, '.3f')} |" for name, (fwd, bwd) in unowned.items()]
        lines.append("")
    if report.phases:
        total = sum(report.phases.values()) or 1.0
        lines += [f"The whole step: {total:.1f} ms per step (measured; the mean of the recorded steps), by phase:", "",
                  "| phase | ms/step | % of the step |", "|---|---:|---:|"]
        lines += [f"| {phase} | {ms:.3f} | {100 * ms / total:.0f} |"
                  for phase, ms in sorted(report.phases.items(), key=lambda item: -item[1])]
        lines.append("")
    if report.step_ms:
        trust = f"Recorded steps took {step_wall_ms(report):.1f} ms (mean)"
        spread, cpu = step_spread(report.step_ms), cpu_per_wall(report.step_ms, report.step_cpu_ms)
        if spread is not None:
            trust += f", spread {100 * spread:.0f}%"
        if cpu is not None:
            trust += f", {cpu:.2f} CPU s per wall s"
        wait = waited_share(report.step_ms, report.step_wait_ms)
        if wait is not None:
            trust += f", its threads waited for a core {100 * wait:.0f}% of the time"
        lines += [trust + ".", ""]
    if report.distortion:
        lines += [f"**These numbers look distorted by other load:** {report.distortion}.", ""]
    if report.regressions:
        lines += ["Regressions, slower than in the earlier cycles beyond the noise (median ms per call):", ""]
        lines += [f"- {_md(r.node)} {r.direction}: {r.baseline_ms:.3f} -> {r.now_ms:.3f} ms ({r.ratio:.2f}x, "
                  f"noise {r.noise_ms:.3f} ms)" for r in report.regressions]
        lines.append("")
    if report.advice:
        lines += ["What to try:", "", *(f"- {text}" for text in report.advice), ""]
    if report.ranges:
        lines += ["FSDP ranges in the trace (ms per step, inside the nodes above):", "",
                  "| range | module | ms per step | calls per step |", "|---|---|---:|---:|"]
        lines += [f"| {_md(r.name)} | {_md(r.module or '(root)')} | {r.ms_per_step:.3f} | {r.calls_per_step:g} |"
                  for r in report.ranges]
    return "\n".join(lines).rstrip("\n")


def modules_text(report: CycleReport, depth: int | None = None) -> str:
    """The module tree, indented like torchprof's, as a Markdown code block (ms per step)."""
    shown = [m for m in report.modules if depth is None or m.depth <= depth]
    rows = [(("  " * m.depth) + (m.path.rsplit(".", 1)[-1] or "(root)") + f" ({m.type_name})", m) for m in shown]
    width = max((len(label) for label, _ in rows), default=10)
    memory = any(m.saved_bytes_per_step is not None or m.param_bytes is not None for m in shown)
    title = "Module tree, ms per step (self: the module's own nodes; total: with its submodules)"
    title += "; MB with its submodules: saved for backward per step, parameters, gradients, optimizer state:" if memory else ":"
    lines = [title, "", "```", f"{'module':<{width}}  self fwd  total fwd   self bwd  total bwd  calls/step"
             + ("  MB saved  MB params  MB grads  MB optim" if memory else "")]
    for label, m in rows:
        lines.append(
            f"{label:<{width}}  {m.self_fwd_ms:8.3f}  {m.total_fwd_ms:9.3f}  {m.self_bwd_ms:9.3f}  {m.total_bwd_ms:9.3f}  {m.calls_per_step:10g}"
            + (f"  {_mb(m.saved_bytes_per_step):>8}  {_mb(m.param_bytes):>9}  {_mb(m.grad_bytes):>8}  {_mb(m.optimizer_bytes):>8}"
               if memory else "")
        )
    lines.append("```")
    return "\n".join(lines)


def memory_line(report: CycleReport, top: int = 5) -> str:
    """What the step holds at the end of its forward, by layer: the bytes autograd keeps for backward (all still held
    then: the forward's peak of saved activations), the layers that hold most, and the model's parameters, gradients
    and optimizer state ('' where memory was not measured)."""
    steps = max(len(report.steps), 1)
    saved = [(n, n.saved_bytes * n.calls / steps) for n in report.nodes if n.saved_bytes is not None]
    if not saved:
        return f"Saved for backward: unknown ({report.memory_note})." if report.memory_note else ""
    total = sum(b for _, b in saved)
    unknown = sum(1 for n in report.nodes if n.saved_bytes is None and n.calls)
    text = f"Held at the end of the forward: {total / 1e6:.3f} MB saved for backward per step"
    largest = [(n, b) for n, b in sorted(saved, key=lambda item: -item[1])[:top] if b > 0]
    if largest and total:
        text += " (" + ", ".join(f"{_md(n.layer or n.name)} {100 * b / total:.0f}%" for n, b in largest) + ")"
    if unknown:
        text += f", {unknown} node{'s' * (unknown > 1)} unknown" + (f" ({report.memory_note})" if report.memory_note else "")
    root = next((m for m in report.modules if m.path == "" and m.param_bytes is not None), None)
    if root is not None:
        text += f"; parameters {root.param_bytes / 1e6:.3f} MB, gradients {root.grad_bytes / 1e6:.3f} MB"
        if root.optimizer_bytes is not None:
            text += f", optimizer state {root.optimizer_bytes / 1e6:.3f} MB"
    return text + "."


def nodes_csv(report: CycleReport) -> str:
    """All node statistics as CSV, one row per node, slowest first."""
    return _csv(NodeStats, report.nodes)


def modules_csv(report: CycleReport) -> str:
    """The module tree as CSV, depth first."""
    return _csv(ModuleStats, report.modules)


def ranges_csv(report: CycleReport) -> str:
    """The FSDP ranges as CSV, slowest first."""
    return _csv(RangeStats, report.ranges)


def step_csv(report: CycleReport) -> str:
    """The rest of the step as CSV rows beside the node rows, ms per recorded step: each phase of the whole
    step (``phases``: ``kind`` phase) and each part of the timed module's forward and backward that no node row
    owns (``unowned``: ``kind`` unowned, ``side`` forward or backward)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["kind", "name", "side", "ms_per_step"])
    for name, ms in report.phases.items():
        writer.writerow(["phase", name, "", round(ms, 6)])
    for name, sides in report.unowned().items():
        for side, ms in zip(("forward", "backward"), sides):
            if ms is not None:
                writer.writerow(["unowned", name, side, round(ms, 6)])
    return buffer.getvalue()


def _csv(record_type: type, records: list) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[f.name for f in fields(record_type)], lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(record).items()})
    return buffer.getvalue()


def _mb(value: float | None, times: float = 1.0) -> str:
    """Bytes (times ``times``) as MB with three decimals; '' for None."""
    return "" if value is None else f"{value * times / 1e6:.3f}"


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _md(text: str) -> str:
    """A code span that is safe inside a Markdown table cell."""
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"
