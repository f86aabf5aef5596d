"""Which layer holds the memory (issue 42): the bytes autograd keeps for each layer's backward, and each module's
parameters, gradients and optimizer state, against answers worked out by hand and measured independently.

What torch 2.11-2.15 saves for the ops used here (its ``derivatives.yaml``, checked on 2.14.1 by reading the autograd
nodes): ``Linear`` on a 2-d input is ``addmm``, which saves its input (``mat1``) and ``weight.t()`` (``mat2``, a view
of the parameter: counted as a parameter); ``relu`` saves its result; ``sin`` and ``cos`` their input; ``mul`` both
operands (each for the other's gradient); a view saves nothing.
"""

from __future__ import annotations

import contextlib
import csv
import warnings

import pytest
import torch
from helpers import LitClassifier, SmallNet, image_loader, make_trainer
from torch import nn
from torch.utils.checkpoint import checkpoint

from fxprof_lightning import FXProfilerCallback, FxprofWarning, Profiler, torch_api
from fxprof_lightning.layout import MODULES_FILE, NODES_FILE

pytestmark = pytest.mark.skipif(not torch_api.READS_SAVED_TENSORS, reason="this torch cannot read saved tensors")
BATCH = 8
F32 = 4  # bytes per float32


def _profile(model, tmp_path, steps=5, optimizer=None, make_input=None, **options):
    """One cycle (a warm-up step, then two recorded steps) of plain training; the report."""
    make_input = make_input or (lambda: torch.randn(BATCH, 32))
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    with Profiler(model, wait=1, warmup=1, active=2, repeat=1, dirpath=tmp_path, torch_profiler=False, pictures=False,
                  sinks=[], **options) as prof:
        for _ in range(steps):
            model(make_input()).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    (cycle,) = prof.cycles
    return cycle


def _saved(cycle) -> dict[str, float | None]:
    return {n.layer: n.saved_bytes for n in cycle.nodes}


def _module(cycle, path):
    return next(m for m in cycle.modules if m.path == path)


def test_a_linear_relu_stack_saves_what_torch_keeps_by_hand(tmp_path):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
    cycle = _profile(model, tmp_path)
    # Each Linear saves its input, which is the ReLU's result before it (counted there, once); each ReLU its result.
    assert _saved(cycle) == {"0 (Linear)": BATCH * 32 * F32, "1 (ReLU)": BATCH * 64 * F32, "2 (Linear)": 0.0,
                             "3 (ReLU)": BATCH * 16 * F32, "4 (Linear)": 0.0}
    assert _module(cycle, "").saved_bytes_per_step == BATCH * (32 + 64 + 16) * F32
    # What the forward keeps once each row has run: the saved activations building up to their peak at its end.
    assert {n.layer: n.saved_held_bytes for n in cycle.nodes} == {
        "0 (Linear)": BATCH * 32 * F32, "1 (ReLU)": BATCH * 96 * F32, "2 (Linear)": BATCH * 96 * F32,
        "3 (ReLU)": BATCH * 112 * F32, "4 (Linear)": BATCH * 112 * F32}
    assert "| bound | node | MB saved/step |" in cycle.to_markdown() and "MB saved  MB params" in cycle.modules_to_text()
    assert f"Held at the end of the forward: {BATCH * 112 * F32 / 1e6:.3f} MB saved for backward" in cycle.to_markdown()


class ViewsAndShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # saves x
        a = h.view(BATCH, 2, 8).sin()  # saves a view of h: h's storage
        b = h.cos()  # saves h: the same storage, not counted again
        return a.view(BATCH, 16) * b  # saves a (a view of sin's result) and b


def test_views_and_tensors_two_layers_save_count_once(tmp_path):
    cycle = _profile(ViewsAndShared(), tmp_path, make_input=lambda: torch.randn(BATCH, 16))
    one = BATCH * 16 * F32
    saved = {n.name: n.saved_bytes for n in cycle.nodes}
    assert saved == {"lin": one, "view": 0.0, "sin": one, "cos": 0.0, "view_1": 0.0, "mul": 2 * one}
    assert _module(cycle, "").saved_bytes_per_step == 4 * one  # x, h, sin's and cos's results


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale  # mul saves the Linear's output (for the scale) and the scale (a parameter)


def test_saved_parameters_count_as_parameters_not_activations(tmp_path):
    cycle = _profile(Scaled(), tmp_path)
    by_op = {n.op: n.saved_bytes for n in cycle.nodes}
    assert by_op == {"call_module": BATCH * 32 * F32, "call_function": BATCH * 32 * F32}  # x; lin's output
    root = _module(cycle, "")
    assert root.saved_bytes_per_step == 2 * BATCH * 32 * F32
    assert root.param_bytes == (32 * 32 + 32 + 32) * F32 == root.grad_bytes


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre = nn.Linear(32, 32)
        self.block = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_block_saves_only_its_inputs(tmp_path, reentrant):
    # A reentrant region's rows run without autograd; its own autograd node, made outside every row, keeps its input:
    # counted for its first row, as a non-reentrant region's (before, that node's bytes were nobody's).
    cycle = _profile(Checkpointed(reentrant), tmp_path)
    one = BATCH * 32 * F32
    assert _module(cycle, "pre").saved_bytes_per_step == one  # x
    assert _module(cycle, "block").saved_bytes_per_step == one  # its input, kept for the recompute
    assert _module(cycle, "head").saved_bytes_per_step == one  # the block's output
    assert _module(cycle, "").saved_bytes_per_step == 3 * one
    # Held once each row has run: the block adds its input at its first row and nothing after; the head, its input.
    held = {n.module_path: n.saved_held_bytes for n in cycle.nodes}
    block = {held[path] for path in held if path.startswith("block")} - {None}  # (reentrant: only the first row's)
    assert held["pre"] == one and block == {2 * one} and held["head"] == 3 * one, held


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), lambda p: torch.optim.AdamW(p)],
                         ids=["sgd_momentum", "adamw"])
def test_optimizer_state_per_module(tmp_path, make):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = make(model.parameters())
    cycle = _profile(model, tmp_path, optimizer=optimizer)
    adam = isinstance(optimizer, torch.optim.AdamW)
    for path, sizes in (("0", (64 * 32, 64)), ("2", (4 * 64, 4)), ("1", ())):
        module = _module(cycle, path)
        assert module.param_bytes == sum(sizes) * F32 == module.grad_bytes
        # SGD: one momentum buffer per parameter; AdamW: two moments and a float32 step per parameter.
        assert module.optimizer_bytes == (sum(2 * s * F32 + F32 for s in sizes) if adam else sum(sizes) * F32)
    assert _module(cycle, "").optimizer_bytes == sum(_module(cycle, p).optimizer_bytes for p in ("0", "2"))


def _unique_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """The saved tensors' unique storage in a plain eager forward, measured with our own saved_tensors_hooks: each
    storage once, the model's parameters and buffers left out."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    del out
    return sum(storages.values())


@pytest.mark.parametrize("make", [SmallNet, ViewsAndShared, Scaled], ids=["small_net", "views", "scaled"])
def test_the_layers_saved_bytes_add_up_to_the_unique_saved_storage(tmp_path, make):
    torch.manual_seed(0)
    model = make()
    shapes = {SmallNet: (BATCH, 3, 8, 8), ViewsAndShared: (BATCH, 16), Scaled: (BATCH, 32)}
    cycle = _profile(model, tmp_path, make_input=lambda: torch.randn(shapes[make]))
    measured = _unique_saved_bytes(model, torch.randn(shapes[make]))
    total = sum(n.saved_bytes * n.calls / len(cycle.steps) for n in cycle.nodes)
    assert measured > 0 and total == pytest.approx(measured, rel=0.01)


def test_training_is_bitwise_unchanged_with_memory_measured(tmp_path):
    def train(profiled: bool):
        torch.manual_seed(0)
        model = SmallNet()
        optimizer = torch.optim.AdamW(model.parameters())
        generator = torch.Generator().manual_seed(1)
        prof = Profiler(model, wait=1, warmup=1, active=2, dirpath=tmp_path, sinks=[], memory=True)
        with prof if profiled else contextlib.nullcontext():
            for _ in range(10):
                model(torch.randn(4, 3, 8, 8, generator=generator)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                if profiled:
                    prof.step()
        return model, prof

    plain, _ = train(False)
    profiled, prof = train(True)
    assert prof.cycles and all(n.saved_bytes is not None for n in prof.cycles[0].nodes)
    assert prof.cycles[0].modules[0].optimizer_bytes > 0
    for (name, a), b in zip(plain.state_dict().items(), profiled.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_users_saved_tensors_hooks_run_untouched_and_leave_the_bytes_unknown(tmp_path):
    packed, unpacked = [], []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor.clone()

    def unpack(tensor):
        unpacked.append(tensor.shape)
        return tensor

    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = Profiler(model, wait=0, warmup=1, active=2, repeat=2, dirpath=tmp_path, torch_profiler=False,
                        pictures=False, sinks=[])
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), prof:
            for _ in range(6):
                before, out = len(packed), model(torch.randn(BATCH, 32))
                assert len(packed) - before == 4 and len(unpacked) == before  # the read unpacked nothing
                out.sum().backward()
                assert len(packed) - before == 4  # every saved tensor went through the user's hook, each step
                assert len(unpacked) == len(packed)  # each unpacked once, by backward
                prof.step()
    assert len(prof.cycles) == 2 and all(n.saved_bytes is None for c in prof.cycles for n in c.nodes)
    assert not [w for w in caught if issubclass(w.category, FxprofWarning)]  # (the hooks are the user's choice)
    markdown = prof.cycles[0].to_markdown()  # said once per cycle, in its report
    assert "MB saved/step" not in markdown and markdown.count("a saved_tensors_hooks of yours packs") == 1


def _same(tensor):
    return tensor


class HooksInside(nn.Module):
    """A block whose forward packs what it saves with hooks of its own (as CPU offload of one block does)."""

    def __init__(self, unpack):
        super().__init__()
        self.pre, self.block, self.head, self.unpack = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4), unpack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x).relu()
        with torch.autograd.graph.saved_tensors_hooks(_same, self.unpack):
            h = self.block(h)
        return self.head(h)


def test_hooks_pushed_inside_the_forward_leave_only_their_rows_unknown(tmp_path):
    unpacked = []

    def unpack(tensor):
        unpacked.append(torch.is_grad_enabled())  # (False in backward; True where a forward's read would run it)
        return tensor

    cycle = _profile(HooksInside(unpack), tmp_path)
    assert len(unpacked) >= 10 and not any(unpacked)  # the block's input and weight, by each backward only
    saved = {m.path: m.saved_bytes_per_step for m in cycle.modules}
    assert saved["pre"] == BATCH * 32 * F32  # x
    # (2.14 runs the rest of the forward eagerly, untimed, after Dynamo's break at the hooks: no rows there)
    assert saved.get("block") is None and saved.get("head", BATCH * 32 * F32) == BATCH * 32 * F32
    if "block" in saved:
        assert "a saved_tensors_hooks of yours packs" in cycle.to_markdown()


def test_reading_runs_no_unpack_hook_and_recomputes_no_checkpointed_region():
    calls, unpacked = [], []

    def block(x):
        calls.append(1)
        return x.sin().cos()

    def unpack(tensor):
        unpacked.append(1)
        return tensor

    x, notes = torch.randn(4, requires_grad=True), None if torch_api.HAS_DATA else []
    torch_api.note_saved_hooks(notes)
    h = checkpoint(block, x * 2, use_reentrant=False)
    with torch.autograd.graph.saved_tensors_hooks(_same, unpack):
        out = h.exp()
    y = out.tanh()  # (unhooked: it saves its result)
    torch_api.note_saved_hooks(None)
    tanh, exp = y.grad_fn, y.grad_fn.next_functions[0][0]
    cos = exp.next_functions[0][0]
    assert [t.data_ptr() for t, hook in torch_api.saved_tensors(tanh, notes)] == [y.data_ptr()] and not unpacked
    assert [hook is not None for _, hook in torch_api.saved_tensors(exp, notes)] == [True]
    assert torch_api.checkpoint_inputs(torch_api.saved_tensors(exp, notes)[0][1], notes) is None  # the user's hook
    (_, hook), = torch_api.saved_tensors(cos, notes)
    _, inputs = torch_api.checkpoint_inputs(hook, notes)
    assert [t.shape for t in inputs if t.numel()] == [x.shape] and calls == [1] and not unpacked  # nothing recomputed nor unpacked
    y.sum().backward()
    assert calls == [1, 1] and unpacked == [1]  # backward alone recomputes the region and unpacks


def test_memory_off_leaves_the_tables_as_they_were(tmp_path):
    cycle = _profile(nn.Sequential(nn.Linear(32, 4)), tmp_path, memory=False)
    assert all(n.saved_bytes is None for n in cycle.nodes)
    assert all(m.saved_bytes_per_step is None and m.param_bytes is None for m in cycle.modules)
    assert "MB saved" not in cycle.to_markdown() + cycle.modules_to_text()


def test_the_lightning_csv_a_user_reads_has_the_memory_columns(tmp_path):
    callback = FXProfilerCallback(skip_first=1, wait=1, warmup=1, active=2, repeat=1, module="model", pictures=False)
    make_trainer(tmp_path, [callback], max_steps=6).fit(LitClassifier(SmallNet()), image_loader())
    (cycle,) = callback.cycles
    with (cycle.directory / NODES_FILE).open() as file:
        nodes = {row["name"]: row for row in csv.DictReader(file)}
    with (cycle.directory / MODULES_FILE).open() as file:
        modules = {row["path"]: row for row in csv.DictReader(file)}
    conv = next(row for row in nodes.values() if row["layer"] == "conv (Conv2d)")
    assert float(conv["saved_bytes"]) == 4 * 3 * 8 * 8 * F32  # the conv saves its input (batch 4, 3x8x8)
    head = SmallNet().head
    head_bytes = sum(p.numel() for p in head.parameters()) * F32
    assert int(modules["head"]["param_bytes"]) == head_bytes == int(modules["head"]["grad_bytes"])
    assert int(modules["head"]["optimizer_bytes"]) == head_bytes  # SGD's momentum buffers (LitClassifier)
    assert float(modules[""]["saved_bytes_per_step"]) == pytest.approx(
        sum(float(row["saved_bytes"]) * int(row["calls"]) / 2 for row in nodes.values()))


@pytest.mark.slow
def test_a_compiled_model_trains_as_without_the_profiler_and_has_no_saved_bytes(tmp_path):
    """torch.compile'd: its layers are timed from its kernels; memory reads nothing of its autograd graph (no saved
    bytes), gives its parameters, gradients and optimizer state, and leaves training bitwise as it was."""
    def train(profiled: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        compiled = torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        generator = torch.Generator().manual_seed(1)
        prof = Profiler(compiled, wait=1, warmup=1, active=2, repeat=1, dirpath=tmp_path, pictures=False, sinks=[])
        with prof if profiled else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FxprofWarning)
            for _ in range(5):
                compiled(torch.randn(BATCH, 32, generator=generator)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                if profiled:
                    prof.step()
        return model, prof

    profiled, prof = train(True)  # (first: the profiler follows the kernels compiled after it starts)
    plain, _ = train(False)
    for (name, a), b in zip(plain.state_dict().items(), profiled.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    (cycle,) = prof.cycles
    assert cycle.capture.method == "compiled" and cycle.nodes and all(n.saved_bytes is None for n in cycle.nodes)
    root = next(m for m in cycle.modules if m.path == "")
    assert root.param_bytes == root.optimizer_bytes == sum(p.numel() for p in profiled.parameters()) * F32


def test_saved_bytes_are_read_without_backward_timing_too(tmp_path):
    # The rows' saved bytes need the autograd sequence range of each node call, which the generated code logged only
    # for backward timing: with backward_timing=False every row's saved bytes were None.
    def stack() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))

    timed, untimed = _profile(stack(), tmp_path / "a"), _profile(stack(), tmp_path / "b", backward_timing=False)
    assert _saved(untimed) == _saved(timed) == {"0 (Linear)": BATCH * 32 * F32, "1 (ReLU)": BATCH * 64 * F32,
                                                "2 (Linear)": 0.0, "3 (ReLU)": BATCH * 16 * F32, "4 (Linear)": 0.0}
    assert all(n.bwd_calls == 0 for n in untimed.nodes) and untimed.memory_note is None
    assert f"Held at the end of the forward: {BATCH * 112 * F32 / 1e6:.3f} MB" in untimed.to_markdown()
