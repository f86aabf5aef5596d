"""Pictures of profiling cycles, as matplotlib figures (the ``plots`` extra: ``pip install 'fxprof-lightning[plots]'``).

- ``slowest_layers(report)``: one cycle's slowest nodes as horizontal bars, forward and backward ms per step stacked,
  slowest on top; each label is the node's name, with the module it ran in below it in grey.
- ``module_icicle(report)``: one cycle's module tree as an icicle: the root on top, one row per depth, each module a
  rectangle as wide as its forward + backward ms per step, its submodules inside its span (the space they leave is
  the module's own time). Colours name the module types.
- ``trend(cycles)``: forward + backward ms per step of the last cycle's slowest nodes over the cycles (x: each cycle's
  last step; a node missing from a cycle is a gap), under the total of all nodes.

``png_bytes(fig)`` renders a figure for a PNG file (``sinks.png_to_array`` turns it into what
``SummaryWriter.add_image(tag, array, step, dataformats="HWC")`` takes). Figures use matplotlib's object API, not pyplot: any thread may draw them, and nothing
keeps them alive once dropped. Every figure is 1000 pixels wide.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

from fxprof_lightning.report import CycleReport, ModuleStats, shorten

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["module_icicle", "png_bytes", "slowest_layers", "tree_of", "trend"]

WIDTH_IN, DPI = 7.0, 100  # 700 px: readable when TensorBoard shows it in a narrow card
FORWARD, BACKWARD, GREY = "#4c72b0", "#dd8452", "#777777"


def _figure(height_in: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("fxprof-lightning's pictures need matplotlib: pip install 'fxprof-lightning[plots]'") from e
    return Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")


def _cycle_title(report: CycleReport) -> str:
    steps = f"steps {report.steps[0]}-{report.steps[-1]}" if report.steps else "no recorded step"
    stage = "Validation cycle" if report.stage == "val" else "Cycle"
    return f"{stage} {report.index}{' (partial)' if report.partial else ''}, {steps}"


def _empty(fig: Figure, message: str) -> Figure:
    fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=12, color=GREY)
    return fig


def slowest_layers(report: CycleReport, top: int = 15) -> Figure:
    """Horizontal bars of the ``top`` slowest nodes of ``report``: forward and backward ms per step, stacked."""
    shown = report.nodes[:top]
    fig = _figure(1.3 + 0.42 * max(len(shown), 2))
    title = f"{_cycle_title(report)}: slowest layers\nms per step (forward {report.forward_ms_per_step:.3g}"
    title += f", backward {report.backward_ms_per_step:.3g})" if report.backward_ms_per_step else ")"
    if not shown:
        fig.suptitle(title)
        return _empty(fig, "no node times")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11, loc="left")
    steps = max(len(report.steps), 1)
    rows = range(len(shown))
    fwd = [n.total_ms / steps for n in shown]
    bwd = [n.bwd_total_ms / steps for n in shown]
    ax.barh(rows, fwd, height=0.7, color=FORWARD, label="forward")
    if any(bwd):  # validation cycles have none
        ax.barh(rows, bwd, height=0.7, left=fwd, color=BACKWARD, label="backward")
    ax.set_yticks(rows, [shorten(n.name, 36, "…") for n in shown], fontsize=9)
    from matplotlib.transforms import ScaledTranslation
    up = ScaledTranslation(0, 6 / 72, fig.dpi_scale_trans)
    for row, (n, label) in enumerate(zip(shown, ax.get_yticklabels())):
        if n.module_path.replace(".", "_") != n.name:  # the module a function ran in, not one the name spells
            label.set_transform(label.get_transform() + up)
            ax.annotate(shorten(n.module_path or "(root)", 44, "…"), (0, row), xycoords=("axes fraction", "data"),
                        xytext=(-3.5, -8.5), textcoords="offset points", ha="right", va="center", fontsize=7.5, color=GREY)
    for row, (f, b) in enumerate(zip(fwd, bwd)):
        ax.annotate(f"{f + b:.3g}", (f + b, row), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(f + b for f, b in zip(fwd, bwd)) * 1.08 or 1)
    ax.set_xlabel("ms per step")
    ax.tick_params(axis="y", length=0)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="lower right", frameon=False)
    return fig


def tree_of(modules: list[ModuleStats]) -> tuple[dict[str, float], dict[str, list[str]], dict[str, str]]:
    """Width (ms per step), children in tree order and type of every module; a container that never ran its own
    forward (an ``nn.ModuleList``) is added as wide as its children."""
    own = {m.path: m.total_fwd_ms + m.total_bwd_ms for m in modules}
    types = {m.path: m.type_name for m in modules}
    children: dict[str, list[str]] = {}
    for path in list(own):
        while path:
            parent = path.rpartition(".")[0]
            if path not in children.setdefault(parent, []):
                children[parent].append(path)
            own.setdefault(parent, 0.0)
            path = parent
    order = lambda p: tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.split("."))  # noqa: E731
    children = {p: sorted(c, key=order) for p, c in children.items()}
    width: dict[str, float] = {}

    def measure(path: str) -> float:
        width[path] = max(own[path], sum(measure(c) for c in children.get(path, [])))
        return width[path]

    measure("")
    return width, children, types


def module_icicle(report: CycleReport, depth: int | None = 3) -> Figure:
    """The module tree of ``report`` as an icicle, ``depth`` levels below the root (None: all)."""
    if not report.modules:
        fig = _figure(2.5)
        fig.suptitle(f"{_cycle_title(report)}: module tree")
        return _empty(fig, "no module tree")
    width, children, types = tree_of(report.modules)
    max_depth = max(m.depth for m in report.modules)
    rows = max_depth if depth is None else min(depth, max_depth)
    fig = _figure(1.6 + 0.62 * (rows + 1))
    ax = fig.add_subplot()
    root = report.modules[0] if report.modules[0].path == "" else None
    total = width[""] or 1.0
    ax.set_title(f"{_cycle_title(report)}: module tree\nforward + backward ms per step (total {width['']:.3g})",
                 fontsize=11, loc="left")
    from matplotlib import colormaps
    palette = list(colormaps["tab20"].colors)
    colour_of: dict[str, tuple] = {}
    px_per_ms = 0.88 * WIDTH_IN * DPI / total

    def draw(path: str, left: float, level: int) -> None:
        type_name = types.get(path, "")
        colour = colour_of.setdefault(type_name, palette[len(colour_of) % len(palette)]) if type_name else "#dddddd"
        ax.barh(level, width[path], left=left, height=0.94, color=colour, edgecolor="white", linewidth=1)
        name = path.rpartition(".")[2] or f"(root) {root.type_name if root else ''}"
        pixels = width[path] * px_per_ms
        for label in (f"{name}\n{width[path]:.3g} ms", name):
            if max(len(line) for line in label.split("\n")) * 6 + 6 < pixels:
                ax.text(left + width[path] / 2, level, label, ha="center", va="center", fontsize=8, clip_on=True)
                break
        if level < rows:
            for child in children.get(path, []):
                draw(child, left, level + 1)
                left += width[child]

    draw("", 0.0, 0)
    ax.set_xlim(0, total)
    ax.set_ylim(rows + 0.5, -0.5)
    ax.set_yticks(range(rows + 1), [f"depth {d}" for d in range(rows + 1)], fontsize=8)
    ax.set_xlabel("ms per step")
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.tick_params(axis="y", length=0)
    if colour_of:
        from matplotlib.patches import Patch
        handles = [Patch(color=c, label=t) for t, c in colour_of.items()]
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=8, frameon=False)
    return fig


def trend(cycles: list[CycleReport], top: int = 8, stage: str = "train") -> Figure:
    """Forward + backward ms per step of the last cycle's ``top`` slowest nodes over the ``stage`` cycles."""
    shown = [c for c in cycles if c.stage == stage and c.steps and c.nodes]
    fig = _figure(6.0)
    what = "Validation cycles" if stage == "val" else "Cycles"
    if not shown:
        fig.suptitle(f"{what}: slowest layers over the cycles")
        return _empty(fig, "no cycle with node times")
    total_ax, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, 2.4])
    steps = [c.steps[-1] for c in shown]
    total_ax.plot(steps, [c.forward_ms_per_step + c.backward_ms_per_step for c in shown], "o-", color="black",
                  linewidth=2.5, label="all nodes")
    total_ax.set_ylabel("all nodes,\nms per step")
    total_ax.set_title(f"{what} {shown[0].index}-{shown[-1].index}: forward + backward ms per step\nof the slowest "
                       f"layers of cycle {shown[-1].index}", fontsize=11, loc="left")
    for node in shown[-1].nodes[:top]:
        ys = []
        for c in shown:
            n = next((n for n in c.nodes if n.name == node.name), None)
            ys.append((n.total_ms + n.bwd_total_ms) / len(c.steps) if n else math.nan)
        ax.plot(steps, ys, "o-", linewidth=1.5, markersize=4, label=shorten(node.name, 30, "…"))
    ax.set_ylabel("ms per step")
    ax.set_xlabel("step (last of the cycle)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    for a in (total_ax, ax):
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return fig


def png_bytes(fig: Figure) -> bytes:
    """The figure as a PNG file's bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()
