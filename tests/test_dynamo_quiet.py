"""What Dynamo says about our captures stays off the user's console, in the capture's record (issue 39, item 6).

Lightning's demo transformer (``nn.Transformer``) reads its causal mask's value in ``_detect_is_causal_mask``, which
breaks Dynamo's graph; on torch 2.11+ Dynamo logs a 20-line ``torch._dynamo`` warning about it (``Graph break from
`Tensor.item()```) that the user's own training never prints. With the profiler it goes to
``Capture.dynamo_messages`` (and ``cycle.jsonl``); the user's own warnings and logs still show, and so does what
Dynamo says outside our captures (the user's own ``torch.compile``), or anywhere when the user turned its logs on.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_trainer
from torch.nn import functional as F
from torch.utils.data import DataLoader

from fxprof_lightning import FXProfilerCallback, FxprofWarning
from fxprof_lightning.timing.quiet import TORCH_LOGS, hold_dynamo_filters, quiet_dynamo, release_dynamo_filters

DYNAMO_LOG = logging.getLogger("torch._dynamo.fake_module")  # a child of Dynamo's logger, as Dynamo's own modules log
USER_LOG = logging.getLogger("a_users_training")


class DemoTransformer(pl.LightningModule):
    """Lightning's demo model, tiny, whose ``training_step`` warns (the user's own warning, each step)."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1)

    def training_step(self, batch, batch_idx):
        warnings.warn(f"the user's own warning at step {self.global_step}", UserWarning, stacklevel=1)
        x, y = batch
        return F.nll_loss(self.model(x, y), y.view(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_loader():
    tokens = torch.randint(0, 50, (16, 2, 10), generator=torch.Generator().manual_seed(0))
    return DataLoader(torch.utils.data.TensorDataset(tokens[:, 0], tokens[:, 1]), batch_size=4)


def _item_hint_again() -> None:
    """Dynamo logs its ``Tensor.item()`` hint once per process (``functools.cache``): forget that it did, so that
    this test sees it whatever ran before in the process."""
    tensor = sys.modules.get("torch._dynamo.variables.tensor")
    hint = getattr(getattr(tensor, "TensorVariable", None), "_warn_capture_scalar_outputs", None)
    if hasattr(hint, "cache_clear"):
        hint.cache_clear()


def _warned(caplog) -> str:
    """The records at WARNING and above that reached pytest's log capture: torch's stderr handler may hold the stream
    pytest gave it first (torch 2.11), which ``capfd``/``capsys`` do not see."""
    return "\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING)


def _dynamo_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "torch/_dynamo" in line or "Graph break" in line
            or "torch._dynamo" in line or "recompil" in line.lower()]


def test_dynamo_says_nothing_on_the_console_during_a_demo_transformer_fit(tmp_path, capfd, caplog, monkeypatch):
    monkeypatch.delenv(TORCH_LOGS, raising=False)
    import torch._dynamo  # noqa: F401  (its loggers set up before the hint is forgotten)

    _item_hint_again()
    callback = FXProfilerCallback(skip_first=0, wait=0, warmup=1, active=2, repeat=1, module="model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [callback], max_steps=3, logger=False).fit(DemoTransformer(), token_loader())
    out, err = capfd.readouterr()
    err += _warned(caplog)
    capture = callback.cycles[0].capture
    assert capture.method == "dynamo" and capture.graph_breaks
    shown = [f"{w.category.__name__}: {w.message}" for w in caught]
    assert not _dynamo_lines(out + err) and not _dynamo_lines("\n".join(shown)), (out + err)[-3000:]
    # The user's own warning, each step, and the package's own (no logger), as without Dynamo's quiet.
    assert sum("the user's own warning" in text for text in shown) == 3
    assert any(issubclass(w.category, FxprofWarning) for w in caught)
    if any("Tensor.item()" in reason for reason in capture.graph_breaks):  # (torch 2.11+: Dynamo logs its hint)
        kept = [m for m in capture.dynamo_messages if "Graph break from `Tensor.item()`" in m]
        assert len(kept) == 1 and "_detect_is_causal_mask" in kept[0]
        written = json.loads((callback.cycles[0].directory / "cycle.jsonl").read_text().splitlines()[0])
        assert written["dynamo_messages"] == capture.dynamo_messages


def _dynamo_warns(message: str) -> None:
    """A warning raised by a module of Dynamo (as ``torch._dynamo``'s code raises its own)."""
    code = compile("import warnings\ndef warn(message):\n    warnings.warn(message, UserWarning)\n",
                   "/site-packages/torch/_dynamo/fake_module.py", "exec")
    namespace = {"__name__": "torch._dynamo.fake_module"}
    exec(code, namespace)
    namespace["warn"](message)


def test_quiet_dynamo_keeps_dynamo_s_messages_and_passes_the_user_s(capsys, caplog, monkeypatch):
    monkeypatch.delenv(TORCH_LOGS, raising=False)
    import torch._dynamo  # noqa: F401  (torch's stderr handler on Dynamo's logger)

    kept: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = warnings.showwarning
        with quiet_dynamo(kept):
            for _ in range(2):  # each message once in the record
                DYNAMO_LOG.warning("a recompile, %s", "inside")
                _dynamo_warns("Dynamo's warning, inside")
            USER_LOG.warning("the user's log, inside")
            warnings.warn("the user's warning, inside", UserWarning, stacklevel=1)
            warnings.warn("the package's warning, inside", FxprofWarning, stacklevel=1)
            with quiet_dynamo([]):  # nested: into the outer block's record
                DYNAMO_LOG.warning("nested")
        assert warnings.showwarning is before
        DYNAMO_LOG.warning("the user's own compile, outside")
        _dynamo_warns("Dynamo's warning, outside")
    err = capsys.readouterr().err + _warned(caplog)
    assert kept == ["WARNING torch._dynamo.fake_module: a recompile, inside",
                    "UserWarning (fake_module.py:3): Dynamo's warning, inside",
                    "WARNING torch._dynamo.fake_module: nested"]
    assert "inside" not in err.replace("the user's log, inside", "") and "nested" not in err
    assert "the user's log, inside" in err and "the user's own compile, outside" in err
    assert [str(w.message) for w in caught] == ["the user's warning, inside", "the package's warning, inside",
                                                "Dynamo's warning, outside"]


def test_held_filters_keep_only_what_a_block_says_and_leave_with_the_release(capsys, caplog, monkeypatch):
    """A timer holds the filters on the handlers while it is installed (a timed call's block is then cheap): between
    blocks Dynamo's records reach the user as before, and after the release no filter of ours is left."""
    monkeypatch.delenv(TORCH_LOGS, raising=False)
    import torch._dynamo  # noqa: F401

    handlers = [h for name in ("torch._dynamo", "torch", "") for h in logging.getLogger(name).handlers]
    before = [list(h.filters) for h in handlers]
    kept: list[str] = []
    hold_dynamo_filters()
    try:
        with quiet_dynamo(kept):
            DYNAMO_LOG.warning("first block")
        DYNAMO_LOG.warning("between the blocks")
        with quiet_dynamo(kept, look=False):
            DYNAMO_LOG.warning("second block")
    finally:
        release_dynamo_filters()
    assert kept == ["WARNING torch._dynamo.fake_module: first block", "WARNING torch._dynamo.fake_module: second block"]
    err = capsys.readouterr().err + _warned(caplog)
    assert "between the blocks" in err and "block" not in err.replace("between the blocks", "")
    assert [list(h.filters) for h in handlers] == before


@pytest.mark.parametrize("how", ["TORCH_LOGS", "level"])
def test_dynamo_s_logs_are_left_alone_when_the_user_turned_them_on(capsys, caplog, monkeypatch, how):
    import torch._dynamo  # noqa: F401

    if how == "TORCH_LOGS":
        monkeypatch.setenv(TORCH_LOGS, "graph_breaks")
    else:
        monkeypatch.delenv(TORCH_LOGS, raising=False)
        monkeypatch.setattr(logging.getLogger("torch._dynamo"), "level", logging.INFO)
    kept: list[str] = []
    with quiet_dynamo(kept):
        DYNAMO_LOG.warning("shown, as the user asked")
    assert "shown, as the user asked" in capsys.readouterr().err + _warned(caplog) and kept == []
