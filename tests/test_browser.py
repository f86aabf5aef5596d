"""What a user sees: TensorBoard's TEXT, IMAGES, SCALARS and CUSTOM SCALARS tabs in headless Chromium.

A module-scoped fixture trains ``LitClassifier`` through a real Trainer and ``TensorBoardLogger`` with
``FXProfilerCallback(wait=0, warmup=1, active=2, repeat=2)`` (two cycles, recording steps [1, 2] and
[4, 5]; text and pictures on), starts ``tensorboard --logdir <logs>`` on a free loopback port and
waits until the run's text, images and scalars are served. A second fixture starts headless
Chromium and drives one page through the Chrome DevTools Protocol (``--remote-debugging-port``
and a websocket; no WebDriver needed). TensorBoard's pages are Polymer and Angular components:
the checks walk the shadow roots under each tab's dashboard element with JavaScript.

The checks, in the rendered pages:

* TEXT: ``fxprof/layers`` renders as one HTML ``<table>`` per cycle, with our header cells and
  exactly the rows of ``CycleReport.to_markdown`` (no raw Markdown left over); ``fxprof/modules``
  renders as one ``<pre>`` block per cycle holding the module tree;
* IMAGES: ``fxprof/slowest_layers``, ``fxprof/module_tree`` and ``fxprof/trend`` are ``<img>``
  elements that loaded, at the size of the last cycle's PNGs;
* SCALARS: the ``fxprof`` group holds the run's few totals and ``fxprof_nodes`` the per-node
  series, each with one point per cycle (checked through the HTTP API too);
* CUSTOM SCALARS: the tab is enabled, its layout is ours and its charts hold every series, a point per cycle.

Not judged here, only seen in the screenshots: with one point per cycle, TensorBoard's default "Ignore
outliers in chart scaling" leaves two-point charts on a [0, 1] y range (they look empty until it is unticked),
and the IMAGES cards show the 700-pixel pictures 350 pixels wide until "Show actual image size" is ticked.

Screenshots of the four tabs go to ``$FXPROF_SCREENSHOTS`` (default ``<tmp>/fxprof_browser``), to look at.
Skipped without Chromium (``apt-get install -y --no-install-recommends chromium``) or without the
websocket client (``pip install websocket-client``).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import LitClassifier, image_loader, make_trainer
from lightning.pytorch.loggers import TensorBoardLogger

from fxprof_lightning import CycleReport, FXProfilerCallback
from fxprof_lightning.outputs.sinks import custom_scalars_layout, cycle_scalars

try:
    import websocket  # the websocket-client package
except ImportError:
    websocket = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium for the browser test: "
                       "apt-get install -y --no-install-recommends chromium"),
    pytest.mark.skipif(not hasattr(websocket, "create_connection"), reason="no websocket client to drive Chromium "
                       "through the DevTools Protocol: pip install websocket-client"),
]

LOAD_DEADLINE_S = 60  # TensorBoard serving the run; a tab rendering
SCREENSHOTS = Path(os.environ.get("FXPROF_SCREENSHOTS", Path(tempfile.gettempdir()) / "fxprof_browser"))
VIEWPORT = {"width": 1600, "height": 1200}


@dataclass
class Served:
    base: str  # http://127.0.0.1:PORT
    run: str  # the run's name in TensorBoard: the logger's version directory relative to the logdir
    callback: FXProfilerCallback
    log: Path  # TensorBoard's stdout and stderr

    @property
    def cycles(self) -> list[CycleReport]:
        return self.callback.cycles


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def poll(check: Callable[[], Any], what: str, alive: Callable[[], str | None], deadline_s: float = LOAD_DEADLINE_S):
    """Call ``check`` until it returns something truthy; fail with ``what`` and the last answer after the deadline.

    ``alive`` returns None while the processes involved run, else why the wait is pointless.
    """
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        dead = alive()
        if dead:
            pytest.fail(f"{what}: {dead}")
        try:
            last = check()
        except (urllib.error.URLError, ConnectionError, OSError, KeyError) as error:
            last = error  # not serving yet
        else:
            if last:
                return last
        time.sleep(0.25)
    pytest.fail(f"{what}: not after {deadline_s} s; last answer {last!r}")


def stop(process: subprocess.Popen) -> None:
    """End a process started in its own session, and whatever is left of its group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def markdown_tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """The header and the rows of each pipe table in ``markdown``, as rendered text (no backticks)."""
    blocks: list[list[str]] = []
    for previous, line in zip(["", *markdown.splitlines()], markdown.splitlines()):
        if line.startswith("|"):
            if not previous.startswith("|"):
                blocks.append([])
            blocks[-1].append(line)

    def cells(line: str) -> list[str]:
        return [cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")]

    for lines in blocks:
        assert len(lines) >= 3 and set(lines[1]) <= set("|-: "), lines[:2]
    return [(cells(lines[0]), [cells(line) for line in lines[2:]]) for lines in blocks]


def code_block(markdown: str) -> str:
    """The text of the first fenced code block in ``markdown``."""
    return markdown.split("```", 2)[1].strip("\n")


def png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(b"\x89PNG\r\n\x1a\n"), png[:8]
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


# --------------------------------------------------------------------------- the browser


class Page:
    """One headless Chromium tab, driven through the Chrome DevTools Protocol over a websocket."""

    def __init__(self, url: str, alive: Callable[[], str | None]) -> None:
        self.ws = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)
        self.alive = alive

    def call(self, method: str, **params: Any) -> dict:
        message_id = next(self.ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:  # events (we enable none, but some come anyway) until our answer
            message = json.loads(self.ws.recv())
            if message.get("id") == message_id:
                assert "error" not in message, f"{method} {params}: {message['error']}"
                return message["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, f"{expression[:300]}\n{result['exceptionDetails']}"
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, what: str) -> Any:
        """Evaluate ``expression`` until it is truthy; its last value is in the failure message."""
        return poll(lambda: self.evaluate(expression), what, self.alive)

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()


# JavaScript: every element under a root, through shadow roots, and the elements of one dashboard (the
# dashboards of the tabs visited before stay in the document, hidden).
DEEP = """
const deep = (root) => {
  const out = [];
  const walk = (node) => {
    for (const el of node.querySelectorAll('*')) { out.push(el); if (el.shadowRoot) walk(el.shadowRoot); }
  };
  walk(root);
  if (root.shadowRoot) walk(root.shadowRoot);
  return out;
};
const dashboard = (name) => deep(document).find((el) => el.tagName === name);
const text = (el) => el.textContent.trim();
"""


def in_dashboard(name: str, body: str) -> str:
    """An expression: ``body`` run with ``board`` the dashboard element (null while the tab has not loaded)."""
    return f"(() => {{ {DEEP} const board = dashboard({name!r}); if (!board) return null; {body} }})()"


TEXT_CARDS = in_dashboard("TF-TEXT-DASHBOARD", """
  return deep(board).filter((el) => el.tagName === 'TF-TEXT-LOADER').map((loader) => {
    const inside = deep(loader);
    return {
      tag: loader.tag, run: loader.run,
      text: inside.filter((el) => el.tagName === 'TF-MARKDOWN-VIEW')
        .map((view) => deep(view).filter((el) => el.tagName === 'DIV').map((div) => div.innerText).join(' ')).join(' '),
      tables: inside.filter((el) => el.tagName === 'TABLE' && el.querySelector(':scope > thead th')).map((table) => ({
        header: [...table.querySelectorAll(':scope > thead th')].map(text),
        rows: [...table.querySelectorAll(':scope > tbody > tr')].map((tr) => [...tr.children].map(text)),
      })),
      pres: inside.filter((el) => el.tagName === 'PRE').map((pre) => pre.textContent),
    };
  });
""")

IMAGE_CARDS = in_dashboard("TF-IMAGE-DASHBOARD", """
  return deep(board).filter((el) => el.tagName === 'TF-IMAGE-LOADER').map((loader) => ({
    tag: loader.tag, run: loader.run,
    images: deep(loader).filter((el) => el.tagName === 'IMG').map((img) => ({
      complete: img.complete, naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
      shownWidth: img.getBoundingClientRect().width, shownHeight: img.getBoundingClientRect().height,
    })),
  }));
""")

# A drawn chart: the points of each series that the line chart (vz-line-chart2) holds, and its y range.
CHART = """
const chart = (card) => {
  const element = deep(card).find((el) => el.tagName === 'VZ-LINE-CHART2');
  const drawn = element && element._chart;
  return drawn ? {points: drawn.datasets.map((d) => d.data().length), y: drawn.yScale.domain()} : null;
};
"""

SCALAR_CARDS = in_dashboard("TF-SCALAR-DASHBOARD", CHART + """
  const groups = deep(board).filter((el) => el.tagName === 'TF-CATEGORY-PAGINATED-VIEW' && el.category);
  const cards = deep(board).filter((el) => el.tagName === 'TF-SCALAR-CARD')
    .map((card) => ({tag: card.tag, chart: chart(card)}));
  return {groups: groups.map((g) => ({name: g.category.name, tags: g.category.items.map((i) => i.tag)})), cards};
""")

CUSTOM_CHARTS = in_dashboard("TF-CUSTOM-SCALAR-DASHBOARD", CHART + """
  return deep(board).filter((el) => el.tagName === 'TF-CUSTOM-SCALAR-MULTI-LINE-CHART-CARD')
    .map((card) => ({title: card.title, chart: chart(card)}));
""")


# --------------------------------------------------------------------------- the fixtures


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("browser")
    torch.manual_seed(0)
    callback = FXProfilerCallback(wait=0, warmup=1, active=2, repeat=2, module="model")
    logger = TensorBoardLogger(save_dir=root / "logs")
    trainer = make_trainer(root, [callback], max_steps=6, logger=logger)
    trainer.fit(LitClassifier(), image_loader())
    assert [c.steps for c in callback.cycles] == [[1, 2], [4, 5]]
    logdir = root / "logs"
    run = Path(logger.log_dir).relative_to(logdir).as_posix()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = root / "tensorboard.log"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
               "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"]
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def alive() -> str | None:
            return None if server.poll() is None else f"TensorBoard exited with {server.returncode}:\n{log_tail(log)}"

        def loaded() -> bool:
            texts = get_json(f"{base}/data/plugin/text/tags").get(run, [])
            images = get_json(f"{base}/data/plugin/images/tags").get(run, {})
            scalars = get_json(f"{base}/data/plugin/scalars/tags").get(run, {})
            return (len(texts) == 2 and {"fxprof/slowest_layers", "fxprof/module_tree", "fxprof/trend"} <= set(images)
                    and "fxprof/forward_ms_per_step" in scalars)

        poll(loaded, f"TensorBoard serving run {run}", alive)
        yield Served(base, run, callback, log)
    finally:
        stop(server)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory):
    profile = tmp_path_factory.mktemp("chromium")
    log = profile.parent / f"{profile.name}.log"
    # --no-sandbox: Chromium refuses its sandbox as root, and containers often lack what it needs; the page is
    # our own loopback TensorBoard.
    command = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--no-default-browser-check", "--no-proxy-server", "--remote-debugging-port=0",
               f"--user-data-dir={profile}", f"--window-size={VIEWPORT['width']},{VIEWPORT['height']}", "about:blank"]
    with open(log, "wb") as out:
        browser = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tab = None
    try:
        def alive() -> str | None:
            return None if browser.poll() is None else f"Chromium exited with {browser.returncode}:\n{log_tail(log)}"

        active_port = profile / "DevToolsActivePort"  # Chromium writes its port there once it listens
        poll(lambda: active_port.exists() and active_port.read_text().split(), "Chromium's DevTools port", alive)
        port = active_port.read_text().split()[0]
        targets = poll(lambda: [t for t in get_json(f"http://127.0.0.1:{port}/json/list") if t["type"] == "page"],
                       "Chromium's page", alive)
        tab = Page(targets[0]["webSocketDebuggerUrl"], alive)
        tab.call("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **VIEWPORT)
        yield tab
    finally:
        if tab is not None:
            tab.close()
        stop(browser)


# --------------------------------------------------------------------------- the checks


def test_text_tab_renders_the_node_table_and_the_module_tree(served: Served, page: Page):
    page.open(f"{served.base}/#text")
    # per cycle: the node table, the time no row owns, the whole step by phase
    expected_tables = [t for c in served.cycles for t in markdown_tables(c.to_markdown(served.callback.profiler.settings.top_k))]
    assert {tuple(header) for header, _ in expected_tables[1::3]} == {("where", "fwd ms/step", "bwd ms/step")}
    assert {tuple(header) for header, _ in expected_tables[2::3]} == {("phase", "ms/step", "% of the step")}
    expected_trees = [code_block(c.modules_to_text(served.callback.profiler.settings.module_depth)) for c in served.cycles]

    def rendered():
        cards = {card["tag"].split("/")[1]: card for card in page.evaluate(TEXT_CARDS) or []
                 if card["run"] == served.run and card["tag"].startswith("fxprof/")}
        nodes, modules = cards.get("layers"), cards.get("modules")
        done = (nodes and modules and len(nodes["tables"]) == len(expected_tables)
                and len(modules["pres"]) == len(served.cycles))
        return done and (nodes, modules)

    nodes, modules = poll(rendered, "the TEXT tab showing fxprof/layers and fxprof/modules", page.alive)
    page.screenshot("text")

    shown = [(table["header"], table["rows"]) for table in nodes["tables"]]
    assert sorted(shown) == sorted(expected_tables)  # every cycle's tables, cell for cell (newest first on the page)
    for header, rows in [table for table in shown if table[0][0] == "layer"]:
        assert {"layer", "node", "fwd ms/call", "bwd ms/call"} <= set(header), header
        names = [row[header.index("node")] for row in rows]
        assert set(names) == {n.name for n in served.cycles[0].nodes}, names  # one row per shown node
    assert "|---" not in nodes["text"] and "| layer |" not in nodes["text"], "Markdown shown raw"

    assert sorted(pre.strip("\n") for pre in modules["pres"]) == sorted(expected_trees)
    assert all("(root) (SmallNet)" in pre and "conv (Conv2d)" in pre for pre in modules["pres"])
    assert "```" not in modules["text"], "Markdown shown raw"


def test_images_tab_shows_the_pictures(served: Served, page: Page):
    page.open(f"{served.base}/#images")
    last = served.cycles[-1].directory  # the newest step is shown first; its PNG files are what TensorBoard got
    expected = {f"fxprof/{name}": png_size((last / f"{name}.png").read_bytes())
                for name in ("slowest_layers", "module_tree", "trend")}
    assert set(expected) == {"fxprof/slowest_layers", "fxprof/module_tree", "fxprof/trend"}

    def loaded():
        cards = {card["tag"]: card["images"] for card in page.evaluate(IMAGE_CARDS) or [] if card["run"] == served.run}
        ready = all(cards.get(tag) and all(img["complete"] and img["naturalWidth"] > 0 for img in cards[tag])
                    for tag in expected)
        return ready and cards

    cards = poll(loaded, f"the IMAGES tab showing {sorted(expected)}", page.alive)
    page.screenshot("images")
    for tag, (width, height) in expected.items():
        (img,) = cards[tag]
        assert (img["naturalWidth"], img["naturalHeight"]) == (width, height), (tag, img)
        assert img["shownWidth"] > 0 and img["shownHeight"] > 0, (tag, img)


def test_scalars_tab_groups_totals_and_nodes_with_a_point_per_cycle(served: Served, page: Page):
    steps = [c.steps[-1] for c in served.cycles]
    expected = [cycle_scalars(c) for c in served.cycles]
    tags = set(expected[0])
    assert all(set(e) == tags for e in expected)  # the same series in every cycle
    for tag in sorted(tags):
        query = urllib.parse.urlencode({"run": served.run, "tag": tag})
        points = get_json(f"{served.base}/data/plugin/scalars/scalars?{query}")
        assert [step for _, step, _ in points] == steps, tag
        assert [value for _, _, value in points] == pytest.approx([e[tag] for e in expected], rel=1e-6), tag

    page.open(f"{served.base}/#scalars")
    totals = sorted(t for t in tags if t.startswith("fxprof/"))

    def drawn():
        found = page.evaluate(SCALAR_CARDS) or {"groups": [], "cards": []}
        charts = {card["tag"]: card["chart"] for card in found["cards"]}
        ready = all(charts.get(tag) and sum(charts[tag]["points"]) >= len(steps) for tag in totals)
        return ready and ({g["name"]: sorted(g["tags"]) for g in found["groups"] if g["name"]}, charts)

    groups, charts = poll(drawn, f"the SCALARS tab drawing {totals}", page.alive)
    page.screenshot("scalars")
    assert groups["fxprof"] == totals and len(totals) <= 6, groups  # the few totals, in the first group opened
    assert groups["fxprof_nodes"] == sorted(t for t in tags if t.startswith("fxprof_nodes/"))  # collapsed at first
    assert {t.split("/")[1] for t in groups["fxprof_nodes"]} == set(served.cycles[0].tracked)
    for tag in totals:
        assert charts[tag]["points"] == [len(steps)], (tag, charts[tag])  # a point per cycle


def test_custom_scalars_tab_shows_our_layout(served: Served, page: Page):
    listing = get_json(f"{served.base}/data/plugins_listing")
    assert listing["custom_scalars"]["enabled"], listing["custom_scalars"]
    layout = get_json(f"{served.base}/data/plugin/custom_scalars/layout")
    tracked = served.cycles[0].tracked
    # the layout the first cycle wrote, with its tracked layers and the run's name in its titles
    ours = custom_scalars_layout(tracked=tracked, run=served.run)
    assert [c["title"] for c in layout["category"]] == list(ours)
    for category in layout["category"]:
        charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
        assert charts == {title: regexes for title, (_, regexes) in ours[category["title"]].items()}

    page.open(f"{served.base}/#custom_scalars")
    # 6 tracked layers: 5 a chart, so that each line of a chart has a symbol of its own (TensorBoard has 5 per chart)
    assert len(tracked) == 6
    run = f" ({served.run})"
    series = {f"{side} ms per call, tracked layers {span}{run}": count
              for side in ("forward", "backward") for span, count in (("1-5", 5), ("6", 1))}
    series[f"ms per step{run}"] = 2
    later = {f"{side} ms per call, layers tracked later{run}" for side in ("forward", "backward")}  # (none here)
    assert set(series) | later == set(ours["fxprof (training)"])

    def drawn():
        charts = {c["title"]: c["chart"] for c in page.evaluate(CUSTOM_CHARTS) or []}
        wanted = {title: count * len(served.cycles) for title, count in series.items()}
        ready = all(charts.get(title) and sum(charts[title]["points"]) >= points for title, points in wanted.items())
        return ready and charts

    charts = poll(drawn, f"the CUSTOM SCALARS tab drawing {sorted(series)}", page.alive)
    page.screenshot("custom_scalars")
    assert set(series) <= set(charts) <= set(series) | later
    for title, count in series.items():
        assert charts[title]["points"] == [len(served.cycles)] * count, (title, charts[title])  # a point per cycle
