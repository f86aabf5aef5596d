"""FX node timing outside Lightning: same numbers as eager, clean install/uninstall, sane samples."""

import copy
import pickle
import time

import pytest
import torch
from helpers import SmallNet, own_forward, resnet18, trace_module

from fxprof_lightning.capture.module_hooks import ModuleHookTimer
from fxprof_lightning.nodes import describe_target
from fxprof_lightning.timing.backward_events import BackwardEvents
from fxprof_lightning.timing.fx_timer import FxNodeTimer


def _forward_backward(model, x):
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("annotate", [False, True])
@pytest.mark.parametrize("make", [SmallNet, lambda: resnet18(num_classes=5)])
def test_outputs_and_gradients_equal_eager(make, annotate):
    eager = make().train()
    timed = copy.deepcopy(eager)
    x = torch.randn(2, 3, 32, 32)
    timer = FxNodeTimer(trace_module(timed), annotate=annotate)

    torch.manual_seed(1)  # dropout draws the same numbers only if timing uses none
    out_ref, grads_ref = _forward_backward(eager, x)
    torch.manual_seed(1)
    timer.install(timed)
    out, grads = _forward_backward(timed, x)
    timer.uninstall(timed)
    random_after_timed = torch.rand(3)

    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(timed.state_dict().values(), eager.state_dict().values(), strict=True))
    torch.manual_seed(1)
    eager(x)
    assert torch.equal(random_after_timed, torch.rand(3))  # timing draws no random numbers


def test_every_node_is_timed_once_per_call():
    model = SmallNet()
    timer = FxNodeTimer(trace_module(model))
    assert [(n.name, n.op) for n in timer.samples.nodes] == [
        ("conv", "call_module"),
        ("bn", "call_module"),
        ("relu", "call_function"),
        ("mean", "call_method"),
        ("drop", "call_module"),
        ("head", "call_module"),
    ]
    assert timer.samples.nodes[2].target == "torch.nn.functional.relu"
    timer.install(model)
    model(torch.randn(2, 3, 8, 8))
    model(torch.randn(2, 3, 8, 8))  # a forward called twice counts two calls
    timer.uninstall(model)
    assert [len(s) for s in timer.samples.fwd] == [2] * 6
    assert all(ns > 0 for s in timer.samples.fwd for ns in s)
    timer.reset()
    assert all(s == [] for s in timer.samples.fwd)


def test_uninstall_restores_the_modules_own_forward():
    model = SmallNet()
    timer = FxNodeTimer(trace_module(model))
    dict_version = torch._C._dynamo.guards.dict_version  # (what Dynamo's guards compare; 2.6-2.15)
    dicts = (vars(model), model._parameters, model._modules)
    tags = [dict_version(d) for d in dicts]
    timer.install(model)
    # For the step its class is a subclass of its own (its name, its pickles and copies); no dict of it is written,
    # so Dynamo's guards can keep skipping a module whose dicts' version tags are unchanged.
    assert "forward" not in vars(model) and not own_forward(model) and isinstance(model, SmallNet) and type(model) is not SmallNet
    assert type(model).__name__ == "SmallNet" and [dict_version(d) for d in dicts] == tags
    copied = copy.deepcopy(model)
    assert type(copied) is SmallNet and {type(pickle.loads(pickle.dumps(model, protocol=p))) for p in (2, 4)} == {SmallNet}
    copied(torch.randn(1, 3, 8, 8))  # (a copy runs its own forward)
    model(torch.randn(1, 3, 8, 8))
    assert all(len(s) == 1 for s in timer.samples.fwd)
    timer.uninstall(model)
    assert own_forward(model) and type(model) is SmallNet
    assert [dict_version(d) for d in dicts] == tags
    timer.reset()
    model(torch.randn(1, 3, 8, 8))
    assert all(s == [] for s in timer.samples.fwd)  # the module's own forward records nothing
    timer.uninstall(model)  # a second uninstall is harmless


def test_module_path_comes_from_the_module_stack():
    timer = FxNodeTimer(trace_module(resnet18()))
    paths = {n.name: n.module_path for n in timer.samples.nodes}
    assert paths["layer1_0_conv1"] == "layer1.0.conv1"
    assert paths["add"] == "layer1.0"  # the residual add inside BasicBlock layer1.0
    assert paths["flatten"] == ""  # torch.flatten in ResNet.forward itself


def test_graphs_with_inputs_after_other_nodes_are_instrumented():
    class Optional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, flag=None, y=None):
            return self.lin(x) if flag is None else x

    # concrete_args puts an assert right after the specialised input, before the next input.
    model = Optional()
    traced = torch.fx.symbolic_trace(model, concrete_args={"flag": None})
    assert [n.op for n in traced.graph.nodes][:4] == ["placeholder", "placeholder", "call_function", "placeholder"]
    timer = FxNodeTimer(traced)
    timer.install(model)
    x = torch.randn(2, 4)
    out = model(x, None, None)
    timer.uninstall(model)
    assert torch.equal(out, model(x)) and [len(s) for s in timer.samples.fwd] == [1, 1]
    assert timer.samples.forward_inputs[0] is x


def test_backward_events_go_to_the_node_call_that_created_them():
    model = SmallNet()
    timer = FxNodeTimer(trace_module(model))
    events = BackwardEvents()
    assert events.start()
    assert not BackwardEvents().start()  # one profiler at a time: a second one declines
    timer.install(model)
    x = torch.randn(2, 3, 8, 8)
    (model(x).sum() + model(x).sum()).backward()  # two calls: each node call gets its own backward
    timer.uninstall(model)
    recorded = events.stop()
    assert not events.running and events.stop() == []
    timer.add_backward(recorded)
    names = [n.name for n in timer.samples.nodes]
    assert {name: len(timer.samples.bwd_ns(i)) for i, name in enumerate(names)} == dict.fromkeys(names, 2)
    assert all(ns > 0 for i in range(len(names)) for ns in timer.samples.bwd_ns(i))
    # Every autograd node the two forwards created is counted once; the loss's sums and add are not.
    ranges = list(zip(timer.samples.firsts, timer.samples.ends, strict=True))
    inside = sum(ns for seq, ns in recorded if any(first <= seq < end for first, end in ranges))
    assert sum(sum(timer.samples.bwd_ns(i)) for i in range(len(names))) == inside < sum(ns for _, ns in recorded)


def test_module_hooks_give_each_backward_event_to_the_innermost_module_once():
    model = resnet18(num_classes=5)
    timer = ModuleHookTimer(model)
    events = BackwardEvents()
    events.start()
    timer.install(model)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    timer.uninstall(model)
    recorded = events.stop()
    timer.add_backward(recorded)
    backward = {node.name: timer.bwd_ns(i) for i, node in enumerate(timer.nodes)}
    assert all(len(backward[name]) == 1 for name in ("conv1", "layer1.0.conv1", "layer4.1.bn2", "fc"))
    assert backward["layer1.0"] and backward["(root)"]  # the residual add, the flatten: self time of the parents
    (root_call,) = [c for c in timer._calls if c[3] == 0]
    inside = sum(ns for seq, ns in recorded if root_call[0] <= seq < root_call[1])
    assert sum(sum(ns) for ns in backward.values()) == inside  # nothing counted twice, nothing lost


def test_backward_marks_by_hooks_cover_the_backward_pass_as_events_do(two_threads):
    """The hook path (CUDA's, and CPU's when another profiler is running), run here on the host clock."""
    model = resnet18(num_classes=5)  # in-place ReLUs, residual branches
    timer = FxNodeTimer(trace_module(model))
    x = torch.randn(2, 3, 32, 32)
    for hooks in (False, True):
        coverage = []
        for _ in range(3):  # the best of three: a busy machine can stall any one backward pass
            timer.reset()
            events = BackwardEvents()
            if not hooks:
                events.start()
            timer.install(model, backward_hooks=hooks)
            loss = model(x).sum()
            timer.uninstall(model)
            start = time.perf_counter_ns()
            loss.backward()
            wall = time.perf_counter_ns() - start
            timer.add_backward(events.stop())
            timer.samples.resolve()
            backward = [timer.samples.bwd_ns(i) for i in range(len(timer.samples.nodes))]
            assert all(len(ns) == 1 and ns[0] > 0 for ns in backward), [n.name for n, ns in zip(timer.samples.nodes, backward) if not ns]
            assert sum(ns[0] for ns in backward) <= wall
            coverage.append(sum(ns[0] for ns in backward) / wall)
        assert max(coverage) > 0.9, (hooks, coverage)  # 97-100 % on a quiet machine, either way
    assert own_forward(model) and timer.samples.marks == []


@pytest.mark.parametrize("reentrant", [True, False])
def test_module_hooks_count_a_checkpointed_block_once(reentrant):
    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x):
            return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=reentrant))

    model = Checkpointed()
    timer = ModuleHookTimer(model)
    events = BackwardEvents()
    events.start()
    timer.install(model)
    loss = model(torch.randn(256, 64, requires_grad=True)).sum()
    start = time.perf_counter_ns()
    loss.backward()  # recomputes the block's forward: not a second call, its backward not counted twice
    wall = time.perf_counter_ns() - start
    timer.uninstall(model)
    timer.add_backward(events.stop())
    assert [len(samples) for samples in timer.fwd] == [1] * len(timer.nodes)
    assert 0 < sum(sum(timer.bwd_ns(i)) for i in range(len(timer.nodes))) <= wall


@pytest.mark.parametrize("make_timer", [lambda m: FxNodeTimer(trace_module(m)), ModuleHookTimer], ids=["nodes", "modules"])
def test_backward_events_given_in_parts_add_up_as_given_at_once(make_timer):
    model = SmallNet()
    timer = make_timer(model)
    events = BackwardEvents()
    events.start()
    timer.install(model)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    timer.uninstall(model)
    recorded = events.stop()
    timer.add_backward(recorded)
    samples = getattr(timer, "samples", timer)  # (module hooks keep their samples themselves)
    at_once = [samples.bwd_ns(i) for i in range(len(samples.nodes))]
    totals = samples.totals if samples is not timer else timer._totals
    totals.clear()  # forget what add_backward added, keep the call ranges the forward noted
    timer.add_backward(recorded[::2])
    timer.add_backward(recorded[1::2])
    assert [samples.bwd_ns(i) for i in range(len(samples.nodes))] == at_once and any(at_once)


def test_torch_functions_read_as_torch_functions():
    traced = torch.fx.symbolic_trace(lambda x: torch.relu(torch.matmul(x, x)).flatten())
    assert [describe_target(n) for n in traced.graph.nodes if n.op == "call_function"] == ["torch.matmul", "torch.relu"]


def test_a_call_cut_short_keeps_the_nodes_that_finished():
    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(4, 4)
            self.second = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    model = Failing()
    timer = FxNodeTimer(trace_module(model))
    timer.install(model)
    x = torch.randn(2, 4)
    model(x)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # the first linear fails: nothing of this call finished
    model(x).sum().backward()
    timer.uninstall(model)
    assert [len(s) for s in timer.samples.fwd] == [2, 2, 2]
    calls = timer.samples.backward_calls()  # the two complete calls, each node creating its autograd nodes once
    assert [name for name, _, _ in calls] == ["first", "relu", "second"] * 2
    assert all(first < end for _, first, end in calls)
    for call in (calls[:3], calls[3:]):  # within a call, each node's autograd nodes follow the previous node's
        assert [end for _, _, end in call[:-1]] == [first for _, first, _ in call[1:]]
