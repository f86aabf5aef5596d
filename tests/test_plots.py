"""Pictures of real cycles: PNG files and TensorBoard arrays that decode, show something, and say the right thing."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import nn

import fxprof_lightning
from fxprof_lightning import Profiler
from fxprof_lightning.outputs.plots import module_icicle, png_bytes, slowest_layers, trend
from fxprof_lightning.outputs.sinks import png_to_array

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.filterwarnings("ignore:.*look distorted by other load")  # a busy test machine


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))  # the addition is a node of module "blocks.N"


class Nested(nn.Module):
    """Blocks in an nn.ModuleList (a container that never runs its own forward) between two linear layers."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.an_output_projection_with_a_name_far_too_long_for_a_label = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return self.an_output_projection_with_a_name_far_too_long_for_a_label(x)


def profile(model: nn.Module, steps: int, directory, validation: bool = False) -> Profiler:
    """Cycles of two recorded steps after one warm-up step; with ``validation``, a validation cycle after step 2."""
    x = torch.randn(4, 8)
    with Profiler(model, wait=0, warmup=1, active=2, repeat=steps // 3, dirpath=directory, torch_profiler=False,
                  sinks=[], profile_validation=validation) as prof:
        for step in range(steps):
            model(x).sum().backward()
            prof.step()
            if validation and step == 2:
                model.eval()
                with torch.no_grad(), prof.validation():
                    for _ in range(3):
                        model(x)
                        prof.step()
                model.train()
    return prof


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> Profiler:
    torch.manual_seed(0)
    return profile(Nested(), 9, tmp_path_factory.mktemp("nested"), validation=True)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Profiler:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    return profile(model, 6, tmp_path_factory.mktemp("mlp"))


def decoded(fig: Figure) -> np.ndarray:
    """The figure's PNG bytes, decoded, checked against the figure's size in pixels."""
    data = png_bytes(fig)
    assert data.startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(io.BytesIO(data), format="png")
    width, height = fig.get_size_inches() * fig.dpi
    assert image.shape[:2] == (round(height), round(width)) and image.shape[2] in (3, 4)
    assert width == 700
    return image


def colours(image: np.ndarray) -> int:
    return len(np.unique(image[..., :3].reshape(-1, 3), axis=0))


def test_slowest_layers_stacks_forward_and_backward_of_the_slowest_nodes(mlp):
    cycle = mlp.cycles[-1]
    fig = slowest_layers(cycle, top=4)
    assert colours(decoded(fig)) > 50  # bars, anti-aliased text: not a blank canvas
    (ax,) = fig.axes
    assert ax.get_title(loc="left").startswith(f"Cycle 1, steps {cycle.steps[0]}-{cycle.steps[-1]}: slowest layers\nms per step")
    assert [t.get_text() for t in ax.get_yticklabels()] == [n.name for n in cycle.nodes[:4]]
    forward, backward = ax.containers
    steps = len(cycle.steps)
    assert [b.get_width() for b in forward] == pytest.approx([n.total_ms / steps for n in cycle.nodes[:4]])
    assert [b.get_width() for b in backward] == pytest.approx([n.bwd_total_ms / steps for n in cycle.nodes[:4]])
    assert [b.get_x() for b in backward] == pytest.approx([b.get_width() for b in forward])  # stacked
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]


def test_slowest_layers_shortens_long_names_and_names_validation_cycles(nested):
    (val,) = nested.val_cycles
    fig = slowest_layers(val)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == len(val.nodes) <= 15
    assert any("…" in label for label in labels) and all(len(label) <= 36 for label in labels)
    assert fig.axes[0].get_title(loc="left").startswith(f"Validation cycle 0, steps {val.steps[0]}-{val.steps[-1]}")
    paths = {t.get_text() for t in fig.axes[0].texts}
    assert {"blocks.0", "blocks.1", "(root)"} <= paths  # the modules the additions and the relu ran in
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["forward"]  # no backward in validation
    decoded(fig)


def icicle_rectangles(fig: Figure) -> dict[tuple[int, float], Rectangle]:
    return {(round(r.get_y() + r.get_height() / 2), r.get_x()): r for r in fig.axes[0].patches}


def test_module_icicle_nests_each_module_inside_its_parent(nested):
    cycle = nested.cycles[-1]
    fig = module_icicle(cycle, depth=None)
    assert colours(decoded(fig)) > 50
    rows: dict[int, list[Rectangle]] = {}
    for (row, _), rect in sorted(icicle_rectangles(fig).items()):
        rows.setdefault(row, []).append(rect)
    assert sorted(rows) == [0, 1, 2, 3, 4]  # root, blocks, blocks.N, blocks.N.mlp, blocks.N.mlp.M
    (root,) = rows[0]
    per_step = {m.path: m.total_fwd_ms + m.total_bwd_ms for m in cycle.modules}
    assert root.get_width() == pytest.approx(per_step[""])
    assert len(rows[1]) == 3  # embed, the blocks container (added, as wide as its blocks) and the projection
    for row in range(1, 5):
        parents = rows[row - 1]
        for rect in rows[row]:  # every rectangle lies inside one rectangle of the row above
            assert any(p.get_x() - 1e-9 <= rect.get_x() and rect.get_x() + rect.get_width() <= p.get_x() + p.get_width() + 1e-6
                       for p in parents)
    labels = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "(root) Nested" in labels
    assert {t.get_text() for t in fig.legends[0].get_texts()} >= {"Nested", "Block", "Linear", "LayerNorm"}
    limited = module_icicle(cycle, depth=2)
    assert {row for row, _ in icicle_rectangles(limited)} == {0, 1, 2}


def test_module_icicle_of_a_root_alone_and_of_no_tree(tmp_path):
    prof = profile(nn.Linear(8, 2), 3, tmp_path)  # no submodule: the tree is the root only
    (cycle,) = prof.cycles
    assert [m.path for m in cycle.modules] == [""]
    fig = module_icicle(cycle)
    assert len(fig.axes[0].patches) == 1
    decoded(fig)
    empty = module_icicle(replace(cycle, modules=[]))
    assert "no module tree" in [t.get_text() for t in empty.texts]
    assert colours(decoded(empty)) > 2
    assert "no node times" in [t.get_text() for t in slowest_layers(replace(cycle, nodes=[])).texts]


def test_trend_follows_the_last_cycles_slowest_nodes_leaving_gaps(nested):
    cycles = nested.cycles
    assert len(cycles) == 3
    slowest = cycles[-1].nodes[0].name
    gap = [cycles[0], replace(cycles[1], nodes=[n for n in cycles[1].nodes if n.name != slowest]), cycles[2]]
    fig = trend([*gap, *nested.val_cycles], top=5)  # validation cycles are left out: their steps count apart
    assert colours(decoded(fig)) > 50
    total_ax, ax = fig.axes
    (total,) = total_ax.get_lines()
    steps = [c.steps[-1] for c in cycles]
    assert list(total.get_xdata()) == steps
    assert list(total.get_ydata()) == pytest.approx([c.forward_ms_per_step + c.backward_ms_per_step for c in gap])
    lines = ax.get_lines()
    assert len(lines) == 5
    label = lines[0].get_label()
    assert label == slowest if len(slowest) <= 30 else (len(label) == 30 and label.startswith(slowest[:14]) and "…" in label)
    ys = lines[0].get_ydata()
    assert not math.isnan(ys[0]) and math.isnan(ys[1]) and not math.isnan(ys[2])  # a gap, not a zero
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in lines]
    val = trend(nested.val_cycles, stage="val")
    assert val.axes[0].get_title(loc="left").startswith("Validation cycles 0-0")


def test_image_array_is_rgb_for_tensorboard(mlp):
    array = png_to_array(png_bytes(slowest_layers(mlp.cycles[0])))
    assert array.dtype == np.uint8 and array.ndim == 3 and array.shape[1:] == (700, 3)
    assert colours(array) > 50
    assert np.array_equal(array, (decoded(slowest_layers(mlp.cycles[0]))[..., :3] * 255).round().astype(np.uint8))


def test_without_matplotlib_the_package_imports_and_pictures_say_what_to_install(tmp_path):
    site_packages = Path(matplotlib.__file__).parents[1]
    without = tmp_path / "site-packages"  # this environment's packages, less matplotlib
    without.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.startswith(("matplotlib", "mpl_toolkits", "pylab")):
            (without / entry.name).symlink_to(entry)
    code = f"""
import site, sys
site.addsitedir({str(without)!r})
sys.path.insert(0, {str(Path(fxprof_lightning.__file__).parents[1])!r})
import fxprof_lightning, fxprof_lightning.outputs.plots
from fxprof_lightning.report import CycleReport
assert "matplotlib" not in sys.modules
try:
    fxprof_lightning.outputs.plots.slowest_layers(CycleReport(index=0, steps=[1]))
except ImportError as e:
    print(e, "|", type(e.__cause__).__name__)
"""
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("fxprof-lightning's pictures need matplotlib: pip install 'fxprof-lightning[plots]'"
                                     " | ModuleNotFoundError")
