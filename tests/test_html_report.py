"""``fxprof report --html``: the page of a real Lightning run, read back with ``html.parser`` and seen in Chromium.

A module-scoped fixture trains ``LitClassifier`` around a nested model (a stem, two blocks in an ``nn.ModuleList``
and a head) with a real Trainer and ``FXProfilerCallback(wait=0, warmup=1, active=3, repeat=3)``: three cycles,
each with its torch.profiler trace. ``fxprof report RUN --html PAGE`` writes the page; the parsed page must show
every section with the numbers of the run's cycles as ``runs.load_run`` reads them back, and the same regressions
as the text report (``cli.check_cycles``). Copies of a real cycle with one node made slower give a page with a
confirmed regression and one with an unconfirmed flag.

The browser test (skipped without Chromium or the websocket client, as ``test_browser.py``) opens the page from a
``file://`` URL with the network emulated offline, checks the rendered sections (sizes of the SVG pictures, table
rows) and that nothing but the page was requested and nothing was logged as an error, and saves a full-page
screenshot to ``$FXPROF_SCREENSHOTS`` (default ``<tmp>/fxprof_browser``) as ``html_report.png``.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer
from test_compare_cli import copy_cycle, edit_nodes, slowest
from torch import nn

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.cli import check_cycles, main
from fxprof_lightning.outputs.formats import ms_text, per_step
from fxprof_lightning.outputs.html_report import SLOWEST_ROWS, write_page
from fxprof_lightning.outputs.runs import load_run
from fxprof_lightning.report import last_sound

try:
    import websocket  # the websocket-client package
except ImportError:
    websocket = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = Path(os.environ.get("FXPROF_SCREENSHOTS", Path(tempfile.gettempdir()) / "fxprof_browser"))
SECTIONS = ["step", "slowest", "cycles", "modules", "memory", "trend", "regressions", "advice", "traces"]
OPTIONS = {"k": 4.0, "min_relative": 0.15}  # the command line's defaults
pytestmark = pytest.mark.filterwarnings("ignore:.*look distorted by other load")  # a busy test machine


class Stage(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, 3, padding=1)
        self.bn = nn.BatchNorm2d(outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Nested(nn.Module):
    """Three levels of modules, and an ``nn.ModuleList`` that never runs its own forward."""

    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = Stage(3, width)
        self.blocks = nn.ModuleList(Stage(width, width) for _ in range(2))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))


@dataclass
class Page:
    """What ``html.parser`` finds in the page: per section its text, tables (id -> rows of cell texts, and each
    row's class), links, SVG elements (with their attributes) and the page's own tags."""

    sections: dict[str, str] = field(default_factory=dict)
    tables: dict[str, list[list[str]]] = field(default_factory=dict)
    row_classes: dict[str, list[str]] = field(default_factory=dict)
    links: dict[str, list[str]] = field(default_factory=dict)
    svg: dict[str, list[tuple[str, dict[str, str]]]] = field(default_factory=dict)
    tags: set[str] = field(default_factory=set)
    order: list[str] = field(default_factory=list)


class PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()
        self.section: str | None = None
        self.table: str | None = None
        self.in_head_row = False
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        self.page.tags.add(tag)
        if tag == "section":
            self.section = attributes["id"]
            self.page.order.append(self.section)
            self.page.sections[self.section] = ""
        elif tag == "table":
            self.table = attributes["id"]
            self.page.tables[self.table], self.page.row_classes[self.table] = [], []
        elif tag == "thead":
            self.in_head_row = True
        elif tag == "tr" and self.table and not self.in_head_row:
            self.page.tables[self.table].append([])
            self.page.row_classes[self.table].append(attributes.get("class", ""))
        elif tag == "td" and self.table:
            self.cell = []
        elif tag == "a" and self.section:
            self.page.links.setdefault(self.section, []).append(attributes["href"])
        if self.section and tag in ("svg", "rect", "polyline", "circle", "g", "text"):
            self.page.svg.setdefault(self.section, []).append((tag, attributes))

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self.section = None
        elif tag == "table":
            self.table = None
        elif tag == "thead":
            self.in_head_row = False
        elif tag == "td" and self.cell is not None and self.table:
            self.page.tables[self.table][-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.section:
            self.page.sections[self.section] += data
        if self.cell is not None:
            self.cell.append(data)


def parse(path: Path) -> Page:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    return parser.page


def report(capsys, *argv: str) -> tuple[int, str]:
    status = main(["report", *argv])
    out, err = capsys.readouterr()
    assert err == "", err
    return status, out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The run directory of a real Lightning fit with three profiled cycles."""
    root = tmp_path_factory.mktemp("html_run")
    torch.manual_seed(0)
    callback = FXProfilerCallback(wait=0, warmup=1, active=3, repeat=3, module="model")
    trainer = make_trainer(root, [callback], max_steps=12)
    trainer.fit(LitClassifier(Nested()), image_loader(samples=12 * 8, batch_size=8))
    assert [c.steps for c in callback.cycles] == [[1, 2, 3], [5, 6, 7], [9, 10, 11]]
    assert all(c.trace_paths for c in callback.cycles)
    return Path(trainer.log_dir)


@pytest.fixture(scope="module")
def page_of_run(trained, tmp_path_factory) -> tuple[Path, int]:
    """The page, written outside the run (the trace links must climb out of its directory), and the exit status."""
    out = tmp_path_factory.mktemp("pages") / "report.html"
    status = main(["report", str(trained), "--html", str(out)])
    assert status == main(["report", str(trained)])  # as without --html
    return out, status


# ------------------------------------------------------------------ the page, parsed


def test_page_shows_every_section_with_the_runs_numbers(trained, page_of_run):
    out, status = page_of_run
    cycles = load_run(trained, stage="train")
    found = check_cycles(cycles, OPTIONS)
    last = last_sound(cycles)  # (what the page reads: the last cycle not distorted by other load)
    page = parse(out)
    assert page.order == SECTIONS

    # the step's phases, in the last cycle: one row per phase, ms per step as recorded
    assert last.phases, "the callback records the phases of the step"
    assert {row[0]: row[1] for row in page.tables["phases"]} == {p: f"{ms:.2f}" for p, ms in last.phases.items()}

    # the cycles table: the numbers of the text report, distorted cycles marked
    rows = page.tables["cycles"]
    assert [row[0] for row in rows] == [str(c.index) for c in cycles]
    for row, css, cycle in zip(rows, page.row_classes["cycles"], cycles, strict=True):
        forward, backward = per_step(cycle)
        assert row[1:5] == [f"{cycle.steps[0]}-{cycle.steps[-1]}", ms_text(forward), ms_text(backward),
                            ms_text(cycle.step_wall_ms)]
        verdict = found[id(cycle)]
        assert (css == "distorted") == (verdict.skipped == "distorted")
        if verdict.distortion:
            assert row[-1] == f"distorted: {verdict.distortion}"

    # the slowest layers of the last cycle, slowest first
    slow = page.tables["slowest"]
    assert len(slow) == min(SLOWEST_ROWS, len(last.nodes))
    for row, node in zip(slow, last.nodes, strict=False):
        assert row[1:3] == [node.layer, node.name] and row[4:7] == [ms_text(node.mean_ms), ms_text(node.bwd_mean_ms),
                                                     ms_text((node.total_ms + node.bwd_total_ms) / len(last.steps))]

    # the advice stored with the last cycle, one item each, code spans as text (the roofline's advice depends on the
    # times against the device's peaks: under load a cycle can have none, seen once in a full suite run)
    assert any(c.advice for c in cycles)
    for advice in last.advice:
        assert advice.replace("`", "") in page.sections["advice"]

    # trace files: relative links that reach each cycle's traces from the page's directory
    links = page.links["traces"]
    assert all(not urllib.parse.urlparse(href).scheme and not href.startswith("/") for href in links)
    reached = [(out.parent / urllib.parse.unquote(href)).resolve() for href in links]
    assert reached == [p.resolve() for c in cycles for p in c.trace_paths]
    assert all(p.name.endswith(".pt.trace.json.gz") and p.is_file() for p in reached)

    # self-contained: no script, no stylesheet or image fetched, nothing but in-page and relative links
    html_text = out.read_text()
    assert not page.tags & {"script", "link", "img", "iframe", "object"}
    assert "http://" not in html_text and "https://" not in html_text and "url(" not in html_text
    assert status in (0, 1)


def test_memory_section_shows_the_layers_that_hold_most(trained, page_of_run):
    out, _ = page_of_run
    last = last_sound(load_run(trained, stage="train"))
    steps = len(last.steps)
    held = sorted(((n.layer, n.saved_bytes * n.calls / steps) for n in last.nodes if n.saved_bytes),
                  key=lambda item: -item[1])
    page = parse(out)
    assert held and [row[1:3] for row in page.tables["memory"]] == [[layer, f"{b / 1e6:.3f}"]
                                                                    for layer, b in held[:SLOWEST_ROWS]]
    # what the forward holds once each of them has run: its own and the layers' before it (docs/memory.md)
    kept = {n.layer: n.saved_held_bytes for n in last.nodes}
    assert [row[-1] for row in page.tables["memory"]] == [f"{kept[layer] / 1e6:.3f}" for layer, _ in held[:SLOWEST_ROWS]]
    total = sum(n.saved_bytes * n.calls / steps for n in last.nodes if n.saved_bytes is not None)
    assert f"Held at the end of the forward: {total / 1e6:.3f} MB saved for backward per step" in page.sections["memory"]
    assert "parameters" in page.sections["memory"] and "optimizer state" in page.sections["memory"]
    assert (last.checkpoint_plan is not None) == ("Checkpointing plan: checkpoint " in page.sections["memory"])


def test_icicle_nests_each_module_inside_its_parent(trained, page_of_run):
    out, _ = page_of_run
    last = last_sound(load_run(trained, stage="train"))
    groups = [a["data-path"] for tag, a in parse(out).svg["modules"] if tag == "g"]
    rects = [a for tag, a in parse(out).svg["modules"] if tag == "rect"]
    boxes = {path: (float(r["x"]), float(r["width"]), float(r["y"])) for path, r in zip(groups, rects, strict=True)}
    expected = {m.path for m in last.modules} | {"blocks"}  # the ModuleList, as wide as its blocks
    assert set(boxes) == expected
    totals = {m.path: m.total_fwd_ms + m.total_bwd_ms for m in last.modules}
    root_x, root_width, _ = boxes[""]
    assert root_x == 0 and root_width > 900
    for path, (x, width, y) in boxes.items():
        if path:
            parent = path.rpartition(".")[0]
            px, pwidth, py = boxes[parent]
            assert y > py and x >= px - 0.02 and x + width <= px + pwidth + 0.02, (path, parent)  # 2 decimals
        if path in totals:  # as wide as its time, less the 1-pixel gap between boxes (at least half a pixel)
            expected = totals[path] / totals[""] * (root_width + 1) - 1
            assert width == pytest.approx(max(expected, 0.5), abs=0.02), path


def test_trend_follows_the_slowest_layers_and_marks_distorted_cycles(trained, page_of_run):
    out, _ = page_of_run
    cycles = load_run(trained, stage="train")
    found = check_cycles(cycles, OPTIONS)
    page = parse(out)
    top = last_sound(cycles).nodes[:6]
    numbers = page.tables["trend-numbers"]
    assert [row[0] for row in numbers] == [str(c.index) for c in cycles]
    for row, cycle in zip(numbers, cycles, strict=True):
        by_name = {n.name: n for n in cycle.nodes}
        assert row[1:] == [ms_text(by_name[n.name].mean_ms + by_name[n.name].bwd_mean_ms) for n in top]
    shapes = page.svg["trend"]
    charts = [a for tag, a in shapes if tag == "svg"]
    assert len(charts) == 2 and all(int(a["width"]) > 0 and int(a["height"]) > 0 for a in charts)
    assert sum(tag == "polyline" for tag, _ in shapes) == 2 + len(top)  # no gaps: every node in every cycle
    assert sum(tag == "circle" for tag, _ in shapes) == (2 + len(top)) * len(cycles)
    distorted = [c.index for c in cycles if found[id(c)].skipped == "distorted"]
    assert sum(a.get("class") == "distorted" for tag, a in shapes if tag == "rect") == 2 * len(distorted)
    if distorted:
        assert "distorted by other load, not checked: " + ", ".join(f"cycle {i}" for i in distorted) \
            in page.sections["trend"]


@pytest.mark.parametrize("kind", ["slow", "blip"])
def test_regressions_say_what_the_text_report_says(capsys, trained, tmp_path, kind):
    """Five copies of a real cycle, the last with its slowest node 3.5x slower: with the step slower by that much it
    is a confirmed regression (exit 1), with the step as before only flagged (exit 0); the page lists it as the text
    does."""
    source = last_sound(load_run(trained, stage="train"))
    node = slowest(source.nodes)
    stats = next(n for n in source.nodes if n.name == node)
    added = 2.5 * stats.median_ms * stats.calls / len(source.steps)
    step = statistics.median(source.step_ms)  # (the copies' steady step: the real one)
    for i in range(5):
        slower = {node: 3.5} if i == 4 else None
        copy = copy_cycle(source.directory, tmp_path / "run" / f"cycle_{i:04d}", i, slower,
                          step + added if slower and kind == "slow" else step)
        edit_nodes(copy / "fx_nodes.csv", None, {  # totals without the outliers a busy machine leaves in them
            "total_ms": lambda row: float(row["median_ms"]) * int(row["calls"]),
            "bwd_total_ms": lambda row: float(row["bwd_median_ms"]) * int(row["bwd_calls"])})
    text_status, text = report(capsys, str(tmp_path / "run"))
    status, _ = report(capsys, str(tmp_path / "run"), "--html")  # the default place: in the run
    assert status == text_status == (1 if kind == "slow" else 0)
    page = parse(tmp_path / "run" / "fxprof_report.html")
    (line,) = [line for line in text.splitlines() if line.startswith("  cycle 4")]
    key = "confirmed" if kind == "slow" else "unconfirmed"
    (row,) = page.tables[key]
    assert row[:3] == ["4", node, "forward"] and row[5] == "3.50x"
    words = line.split()  # cycle 4 NODE forward BEFORE -> NOW RATIO noise NOISE
    assert [words[1], *words[2:5], words[6], words[7], words[9]] == row
    assert ("confirmed" in page.tables) == (kind == "slow")
    if kind == "blip":
        assert "No regression beyond the noise in 5 cycle(s)" in page.sections["regressions"]
        assert "not yet confirmed" in page.sections["regressions"] and "not yet confirmed" in text
    assert page.tables["cycles"][-1][6] == ("1" if kind == "slow" else "0")


def test_html_page_that_cannot_be_written_is_a_usage_error(capsys, trained, tmp_path):
    status = main(["report", str(trained), "--html", str(tmp_path / "missing" / "page.html")])
    _, err = capsys.readouterr()
    assert status == 2 and "--html" in err and "cannot write the page" in err and "Traceback" not in err


# ------------------------------------------------------------------ the page, in Chromium


class Browser:
    """Headless Chromium on one tab, driven through the DevTools Protocol; keeps the events it is sent."""

    def __init__(self, profile: Path) -> None:
        command = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
                   f"--user-data-dir={profile}", "--window-size=1280,1000", "about:blank"]
        self.log = profile.parent / f"{profile.name}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        port = self.wait(lambda: port_file.exists() and port_file.read_text().split()[0], "Chromium's DevTools port")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as answer:
            target = next(t for t in json.loads(answer.read()) if t["type"] == "page")
        self.ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    def wait(self, check, what: str, deadline_s: float = 60) -> Any:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"Chromium exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError, ValueError):
                if result := check():
                    return result
            time.sleep(0.2)
        pytest.fail(f"{what}: not after {deadline_s} s")

    def call(self, method: str, **params: Any) -> dict:
        message_id = next(self.ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == message_id:
                assert "error" not in message, f"{method}: {message['error']}"
                return message["result"]
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=15)
                return
            except subprocess.TimeoutExpired:
                continue


RENDERED = """(() => {
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.width, r.height]; };
  return {
    sections: [...document.querySelectorAll('section')].map((s) => ({id: s.id, size: box(s)})),
    icicle: box(document.querySelector('#icicle')),
    icicleRects: document.querySelectorAll('#icicle rect').length,
    charts: [...document.querySelectorAll('svg.chart')].map(box),
    lines: document.querySelectorAll('svg.chart polyline').length,
    phaseBar: box(document.querySelector('.phasebar')),
    phaseParts: [...document.querySelectorAll('.phasebar span')].map((s) => box(s)[0]),
    rows: Object.fromEntries([...document.querySelectorAll('table')].map((t) => [t.id, t.tBodies[0].rows.length])),
    width: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
    viewport: window.innerWidth,
    slowestFirstRow: document.querySelector('#slowest tbody tr').getBoundingClientRect().bottom,
  };
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install -y --no-install-recommends chromium")
@pytest.mark.skipif(not hasattr(websocket, "create_connection"), reason="no websocket client: pip install "
                    "websocket-client")
def test_page_renders_offline_in_chromium(trained, page_of_run, tmp_path):
    out, _ = page_of_run
    cycles = load_run(trained, stage="train")
    last = last_sound(cycles)  # (what the page reads: the last cycle not distorted by other load)
    browser = Browser(tmp_path / "chromium")
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.call(f"{domain}.enable")
        browser.call("Network.emulateNetworkConditions", offline=True, latency=0, downloadThroughput=-1,
                     uploadThroughput=-1)
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=1000, deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", url=out.as_uri())
        browser.wait(lambda: browser.evaluate("document.readyState") == "complete", "the page loading")
        shown = browser.evaluate(RENDERED)

        metrics = browser.call("Page.getLayoutMetrics")["cssContentSize"]
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shot = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                            clip={"x": 0, "y": 0, "width": metrics["width"], "height": metrics["height"], "scale": 1})
        (SCREENSHOTS / "html_report.png").write_bytes(base64.b64decode(shot["data"]))
        events = list(browser.events)
    finally:
        browser.close()

    assert [s["id"] for s in shown["sections"]] == SECTIONS
    assert all(w > 0 and h > 0 for s in shown["sections"] for w, h in [s["size"]])
    assert shown["width"] <= shown["viewport"], "the page scrolls sideways"
    assert shown["icicle"][0] > 800 and shown["icicle"][1] > 100  # four rows of boxes: root, its children, blocks.N...
    assert shown["icicleRects"] == len({m.path for m in last.modules} | {"blocks"})
    assert len(shown["charts"]) == 2 and all(w > 800 and h > 150 for w, h in shown["charts"])
    assert shown["lines"] == 2 + min(6, len(last.nodes))
    assert shown["phaseBar"][0] > 800 and shown["phaseBar"][1] > 20
    assert shown["slowestFirstRow"] < 1000  # the first screen (1280 x 1000): the step split, then the slowest layer
    assert sum(shown["phaseParts"]) == pytest.approx(shown["phaseBar"][0], abs=2)
    assert shown["rows"]["cycles"] == len(cycles) and shown["rows"]["slowest"] == min(SLOWEST_ROWS, len(last.nodes))
    assert shown["rows"]["trace-files"] == len(cycles)

    requests = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
    assert requests and all(url.startswith("file://") for url in requests), requests  # the page, nothing else
    failed = [e["params"] for e in events if e.get("method") == "Network.loadingFailed"]
    errors = [e["params"] for e in events if e.get("method") in ("Runtime.exceptionThrown",)
              or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")
              or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    assert failed == [] and errors == [], (failed, errors)


def test_names_from_the_run_are_escaped(trained, tmp_path):
    """A node, module type and advice holding markup show as text: the page gains no element from them."""
    cycles = load_run(trained, stage="train")
    last = last_sound(cycles)  # (what the page reads: the last cycle not distorted by other load)
    odd = '<img src="http://example.com/x.png" onerror="alert(1)">&amp;'
    last.nodes = [replace(last.nodes[0], name=odd, module_path=odd, layer=odd), *last.nodes[1:]]
    last.modules = [replace(m, type_name=odd) if m.path == "stem" else m for m in last.modules]
    last.advice = [f"`{odd}` is slow"]
    out = write_page(tmp_path / "page.html", cycles, check_cycles(cycles, OPTIONS), run=f"{trained}/{odd}",
                     title="3 training cycle(s)", options=OPTIONS)
    page = parse(out)
    assert "img" not in page.tags and "<img" not in out.read_text()
    assert page.tables["slowest"][0][1:3] == [odd, odd] and odd in page.sections["advice"] and odd in page.sections["modules"]
    assert page.order == SECTIONS
