"""How far the capture ladder gets on real model zoos, and whether timing changes anything.

    .venv/bin/python benchmarks/model_zoo.py            # every model, then the experiments
    .venv/bin/python benchmarks/model_zoo.py --quick    # 2-3 models per family, no experiments

For each model of torchvision, timm and HuggingFace transformers (built small from its class or
config, never with downloaded weights; a family whose package is missing is skipped with a
note), on CPU, in train mode:

1. ``capture(model, example)`` (``fxprof_lightning.capture``) with the model's call recorded as
   the example, which is what the callback does once it has recorded the model's first call, and
   the timer the callback picks for it (``FXProfilerCallback._capture``): ``GuardedNodeTimer`` for
   a graph traced on the example, ``NodeTimer`` for another graph, else ``ModuleHookTimer``;
2. one reference forward + backward of the uninstrumented model (seeded), then two timed
   forward + backward with the timer installed (same seed), exactly as in a warm-up and a recorded
   step (``reset``, ``install``, forward, loss = sum of the float outputs, backward, ``uninstall``,
   backward times from profiler events where the timer uses them, ``resolve``); the times shown
   are the second step's;
3. outputs (every tensor they hold, caches included) and parameter gradients of each timed run
   compared with ``torch.equal``. If they differ in train mode, the comparison is repeated in eval
   mode (captured again in eval mode, as the callback does per mode) to tell randomness (dropout,
   stochastic depth) from a wrong graph;
4. one more timed step with the same timer on inputs of other shapes (batch 3, 12 tokens; images
   keep their size), compared with the uninstrumented model on them: does a graph specialised on
   the example still run (``=``), or does a guard send the call to the model's own forward
   (``= own``), and is the result still the model's?

One row per model: the capture method, timed nodes (and how many ran), leaf modules, guards,
whether outputs and gradients are equal, the other-shapes step, the nodes with backward time,
the summed forward and backward node times, the capture time. Leaves and errors follow the row.
A summary counts capture methods per family.

The experiments (full run; ``--no-experiments`` to skip them, ``--no-dynamo`` to skip the slow
last one) try, on the models the ladder did not capture whole (leaves or module hooks), what
could give more FX nodes than the package does today:

* ``on example, leaves too``: rung 3 (``observed.trace_on_example``) also where rung 2 succeeded
  with leaves (the package uses it only when the root's own forward fails);
* ``per-child``: each module captured on its own, on its own first call (recorded with a forward
  pre-hook per module), descending into the children of modules that stay untraceable; traced
  subtrees get a timer each, the remaining modules module hooks (a hybrid timer);
* ``dynamo``: ``torch._dynamo.export`` with the example inputs (a torch-level graph, specialised
  on the example), timed with ``NodeTimer``.

Each is timed and checked like the models above, on both input shapes, and the model must have
its own forward back, no hook left, after ``uninstall``. A last table sums it up.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxprof_lightning.capture import Capture, capture
from fxprof_lightning.leaves import short_error
from fxprof_lightning.module_hooks import ModuleHookTimer
from fxprof_lightning.node_timing import BackwardEvents, NodeTimer, is_timed, tensors_in
from fxprof_lightning.observed import Example, GuardedNodeTimer, trace_on_example

BATCH = 2
IMAGE = 64  # CNNs: 3 x 64 x 64
SEQ = 16  # text models: 16 tokens
VOCAB = 128


# ------------------------------------------------------------------ the zoo


@dataclass
class Spec:
    """A model to try: how to build it and what it is called with."""

    family: str
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]
    quick: bool = False
    note: str = ""


def image_input(size: int = IMAGE) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda: ((torch.randn(BATCH, 3, size, size),), {})


def text_input(**extra: Callable[[], Any]) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    def make() -> tuple[tuple[Any, ...], dict[str, Any]]:
        input_ids = torch.randint(1, VOCAB, (BATCH, SEQ))
        attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        attention_mask[1, SEQ - 4:] = 0  # the second sequence is padded: the mask matters
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        kwargs.update({k: f() for k, f in extra.items()})
        return (), kwargs

    return make


def torchvision_specs() -> list[Spec]:
    import torchvision
    from torchvision import models as tvm

    def tv(name: str, **kw: Any) -> Callable[[], nn.Module]:
        return lambda: tvm.get_model(name, weights=None, num_classes=10, **kw)

    def small_vit() -> nn.Module:
        # vit_b_16's architecture (torchvision.models.VisionTransformer) in a tiny configuration.
        return tvm.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                     mlp_dim=64, num_classes=10)

    del torchvision
    return [
        Spec("torchvision", "resnet18", tv("resnet18"), image_input(), quick=True),
        Spec("torchvision", "mobilenet_v3_small", tv("mobilenet_v3_small"), image_input(), quick=True),
        Spec("torchvision", "efficientnet_b0", tv("efficientnet_b0"), image_input()),
        Spec("torchvision", "vit_b_16 (tiny cfg)", small_vit, image_input(32), quick=True,
             note="VisionTransformer(image_size=32, patch_size=8, 2 layers, hidden 32)"),
        Spec("torchvision", "convnext_tiny", tv("convnext_tiny"), image_input()),
        Spec("torchvision", "densenet121", tv("densenet121"), image_input()),
        Spec("torchvision", "squeezenet1_0", tv("squeezenet1_0"), image_input()),
        Spec("torchvision", "shufflenet_v2_x0_5", tv("shufflenet_v2_x0_5"), image_input()),
        Spec("torchvision", "regnet_y_400mf", tv("regnet_y_400mf"), image_input()),
        Spec("torchvision", "swin_t", tv("swin_t"), image_input()),
    ]


def timm_specs() -> list[Spec]:
    import timm

    def tm(name: str, **kw: Any) -> Callable[[], nn.Module]:
        return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw)

    specs = [
        Spec("timm", "resnet18", tm("resnet18"), image_input(), quick=True),
        Spec("timm", "vit_tiny_patch16_224 (img 32)", tm("vit_tiny_patch16_224", img_size=32), image_input(32),
             quick=True),
        Spec("timm", "convnext_atto", tm("convnext_atto"), image_input(), quick=True),
        Spec("timm", "efficientnet_b0", tm("efficientnet_b0"), image_input()),
        Spec("timm", "mobilevitv2_050", tm("mobilevitv2_050"), image_input()),
        Spec("timm", "swin_tiny_patch4_window7 (56px,2+2)",
             tm("swin_tiny_patch4_window7_224", img_size=56, depths=(2, 2), num_heads=(3, 6), embed_dim=48),
             image_input(56)),
        Spec("timm", "levit_128s", tm("levit_128s", img_size=64), image_input()),
    ]
    names = {"swin_tiny_patch4_window7": "swin_tiny_patch4_window7_224"}
    return [s for s in specs if timm.is_model(names.get(s.name.split(" ")[0], s.name.split(" ")[0]))]


def transformers_specs() -> list[Spec]:
    import transformers as hf

    def tiny(config_cls: Any, model_cls: Any, **kw: Any) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            config = config_cls(**kw)
            return model_cls(config)

        return build

    bert = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=64)
    gpt2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, use_cache=False,
                bos_token_id=0, eos_token_id=0)
    t5 = dict(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
              use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    bart = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    llama = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
                 pad_token_id=0)
    distil = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)
    vit = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64)
    decoder_ids = {"decoder_input_ids": lambda: torch.randint(3, VOCAB, (BATCH, SEQ // 2))}
    return [
        Spec("transformers", "BertModel", tiny(hf.BertConfig, hf.BertModel, **bert), text_input(), quick=True),
        Spec("transformers", "DistilBertModel", tiny(hf.DistilBertConfig, hf.DistilBertModel, **distil),
             text_input()),
        Spec("transformers", "GPT2Model", tiny(hf.GPT2Config, hf.GPT2Model, **gpt2), text_input()),
        Spec("transformers", "GPT2LMHeadModel", tiny(hf.GPT2Config, hf.GPT2LMHeadModel, **gpt2), text_input(),
             quick=True),
        Spec("transformers", "T5Model", tiny(hf.T5Config, hf.T5Model, **t5), text_input(**decoder_ids)),
        Spec("transformers", "BartModel", tiny(hf.BartConfig, hf.BartModel, **bart), text_input(**decoder_ids)),
        Spec("transformers", "LlamaModel", tiny(hf.LlamaConfig, hf.LlamaModel, **llama), text_input()),
        Spec("transformers", "LlamaForCausalLM", tiny(hf.LlamaConfig, hf.LlamaForCausalLM, **llama), text_input(),
             quick=True),
        Spec("transformers", "LlamaForCausalLM use_cache=True",
             tiny(hf.LlamaConfig, hf.LlamaForCausalLM, **{**llama, "use_cache": True}), text_input(),
             note="the config's default: the forward builds a DynamicCache and returns it"),
        Spec("transformers", "ViTModel", tiny(hf.ViTConfig, hf.ViTModel, **vit),
             lambda: ((), {"pixel_values": torch.randn(BATCH, 3, 32, 32)})),
    ]


FAMILIES: list[tuple[str, str, Callable[[], list[Spec]]]] = [
    ("torchvision", "torchvision", torchvision_specs),
    ("timm", "timm", timm_specs),
    ("transformers", "transformers", transformers_specs),
]


# ------------------------------------------------------------------ one step, as the callback runs it


def output_tensors(value: Any, depth: int = 6) -> list[torch.Tensor]:
    """Every tensor an output holds, also inside objects (an HF ``DynamicCache``'s keys and values)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0 or isinstance(value, (nn.Module, type, str, bytes)):
        return []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values())
    return [t for item in items for t in output_tensors(item, depth - 1)]


def loss_of(output: Any) -> torch.Tensor | None:
    """The sum of every floating-point output tensor that needs a gradient."""
    parts = [t.float().sum() for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    return torch.stack(parts).sum() if parts else None


def call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int = 0) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
    """One seeded forward + backward: the output tensors and the parameter gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = model(*args, **kwargs)
    loss = loss_of(output)
    if loss is not None:
        loss.backward()
    outs = [t.detach().clone() for t in output_tensors(output)]
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return outs, grads


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def same_grads(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((a[k], b[k]) for k in a))


def timer_for(model: nn.Module, how: Capture) -> NodeTimer | ModuleHookTimer:
    """``FXProfilerCallback._capture``'s choice, on CPU without torch.profiler."""
    if how.on_example:
        return GuardedNodeTimer(how.graph_module)
    if how.graph_module is not None:
        return NodeTimer(how.graph_module)
    return ModuleHookTimer(model)


@dataclass
class Timed:
    """What one timed step measured."""

    outs: list[torch.Tensor]
    grads: dict[str, Any]
    nodes: int
    ran: int  # nodes with at least one forward sample
    with_bwd: int  # nodes with a backward time > 0
    fwd_ms: float
    bwd_ms: float
    mismatch: str | None  # why a graph traced on an example did not fit the call (its own forward ran)


def timed_step(model: nn.Module, timer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int = 0) -> Timed:
    """A recorded step: reset, install, forward, loss, backward, uninstall, backward events, resolve."""
    model.zero_grad(set_to_none=True)
    events = BackwardEvents() if timer.uses_backward_events else None
    timer.reset()
    timer.install(model)
    if events is not None:
        events.start()
    try:
        torch.manual_seed(seed)
        output = model(*args, **kwargs)
        loss = loss_of(output)
        if loss is not None:
            loss.backward()
    finally:
        timer.uninstall(model)
        backward = events.stop() if events is not None else []
    timer.add_backward(backward)
    timer.resolve()
    outs = [t.detach().clone() for t in output_tensors(output)]
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    bwd = [sum(timer.bwd_ns(i)) for i in range(len(timer.nodes))]
    return Timed(outs, grads, len(timer.nodes), sum(1 for f in timer.fwd if f), sum(1 for b in bwd if b > 0),
                 sum(map(sum, timer.fwd)) / 1e6, sum(bwd) / 1e6, getattr(timer, "mismatch", None))


def other_inputs(spec: Spec) -> tuple[tuple, dict]:
    """The spec's inputs with batch 3 and 12 tokens (images keep their size)."""
    global BATCH, SEQ
    saved = BATCH, SEQ
    BATCH, SEQ = 3, 12
    try:
        torch.manual_seed(1)
        return spec.inputs()
    finally:
        BATCH, SEQ = saved


def other_shapes_step(model: nn.Module, timer: Any, other: tuple[tuple, dict]) -> str:
    """A step on other inputs with the same timer: '=' (the graph ran, equal), '= own' (a guard sent the
    call to the model's own forward, equal), '!' (not equal) or 'FAILED'."""
    ref_outs, ref_grads = call(model, *other)
    try:
        got = timed_step(model, timer, *other)
    except Exception as error:
        return f"FAILED {short_error(error)[:110]}"
    if not (same(ref_outs, got.outs) and same_grads(ref_grads, got.grads)):
        return "!"
    return "= own" if got.mismatch else "="


# ------------------------------------------------------------------ one model


@dataclass
class Row:
    family: str
    model: str
    params: int = 0
    method: str = "-"
    nodes: int = 0
    ran: int = 0
    leaves: dict[str, str] = field(default_factory=dict)
    guards: int = 0
    out_eq: str = "-"
    grad_eq: str = "-"
    other: str = "-"  # the step on inputs of other shapes (see other_shapes_step)
    bwd: str = "-"
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    capture_s: float = 0.0
    error: str = ""  # Capture.error (why tracing the whole module failed)
    failure: str = ""  # an exception of this script's run (build, forward, ...)
    notes: list[str] = field(default_factory=list)


def run_model(spec: Spec) -> tuple[Row, nn.Module | None, tuple[Any, ...], dict[str, Any]]:
    row = Row(spec.family, spec.name)
    model, args, kwargs = None, (), {}
    try:
        torch.manual_seed(0)
        model = spec.build()
        args, kwargs = spec.inputs()
        row.params = sum(p.numel() for p in model.parameters())
        model.train()
        ref_outs, ref_grads = call(model, args, kwargs)

        start = time.perf_counter()
        how = capture(model, Example.copy_of(args, kwargs))
        row.capture_s = time.perf_counter() - start
        row.method, row.leaves, row.error, row.guards = how.method, dict(how.leaves), how.error, how.guards
        timer = timer_for(model, how)
        got = timed_step(model, timer, args, kwargs)
        again = timed_step(model, timer, args, kwargs)  # the recorded step after a warm-up one, as scheduled
        row.nodes, row.ran, row.fwd_ms, row.bwd_ms = again.nodes, again.ran, again.fwd_ms, again.bwd_ms
        row.bwd = f"{again.with_bwd}/{again.nodes}"
        out_eq = same(ref_outs, got.outs) and same(ref_outs, again.outs)
        grad_eq = same_grads(ref_grads, got.grads) and same_grads(ref_grads, again.grads)
        row.out_eq, row.grad_eq = ("yes" if out_eq else "NO"), ("yes" if grad_eq else "NO")
        row.other = other_shapes_step(model, timer, other_inputs(spec))
        if not (out_eq and grad_eq):
            # Same seed, and a different result: is it randomness in train mode, or the graph?
            again_outs, again_grads = call(model, args, kwargs)
            deterministic = same(ref_outs, again_outs) and same_grads(ref_grads, again_grads)
            row.notes.append("train mode: the uninstrumented model itself gives " +
                             ("the same result twice with the same seed" if deterministic else
                              "different results with the same seed (non-deterministic kernels)"))
            model.eval()
            eval_ref_outs, eval_ref_grads = call(model, args, kwargs)
            eval_how = capture(model, Example.copy_of(args, kwargs))
            eval_got = timed_step(model, timer_for(model, eval_how), args, kwargs)
            e_out, e_grad = same(eval_ref_outs, eval_got.outs), same_grads(eval_ref_grads, eval_got.grads)
            row.out_eq += f"/eval {'yes' if e_out else 'NO'}"
            row.grad_eq += f"/eval {'yes' if e_grad else 'NO'}"
            model.train()
    except Exception as error:  # one model's failure must not stop the run
        row.failure = short_error(error)
        row.notes.append("".join(traceback.format_exception(error)[-3:]).strip().replace("\n", " | ")[:400])
    return row, model, args, kwargs


# ------------------------------------------------------------------ printing


def shorten_names(names: list[str], limit: int = 4) -> str:
    """Leaf names with numbers folded: ``features.denseblock*.denselayer* x58``."""
    groups = Counter(re.sub(r"\d+", "*", n) for n in names)
    parts = [f"{g} x{c}" if c > 1 else g for g, c in groups.most_common()]
    if len(parts) > limit:
        parts = [*parts[:limit], f"+{len(parts) - limit} more"]
    return ", ".join(parts)


COLUMNS = [("source", 12), ("model", 34), ("params", 7), ("capture", 24), ("nodes", 5), ("ran", 5), ("leaves", 6),
           ("guards", 6), ("out==", 11), ("grad==", 11), ("other", 6), ("bwd>0", 8), ("fwd ms", 8), ("bwd ms", 8),
           ("cap s", 6)]


def header() -> str:
    line = " ".join(f"{name:<{width}}" for name, width in COLUMNS)
    return line + "\n" + "-" * len(line)


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.0f}k"


def format_row(row: Row) -> str:
    values = [row.family, row.model, fmt_params(row.params), row.method, row.nodes, row.ran, len(row.leaves),
              row.guards, row.out_eq, row.grad_eq, row.other, row.bwd, f"{row.fwd_ms:.1f}", f"{row.bwd_ms:.1f}",
              f"{row.capture_s:.2f}"]
    line = " ".join(f"{str(v)[:w]:<{w}}" for v, (_, w) in zip(values, COLUMNS))
    details = []
    if row.leaves:
        details.append(f"leaves: {shorten_names(list(row.leaves))}")
        reasons = Counter(row.leaves.values())
        details.extend(f"  leaf reason (x{c}): {r}" for r, c in reasons.most_common(3))
    if row.error and (row.method != "symbolic_trace+leaves"):
        details.append(f"error: {row.error}")
    if row.other.startswith("FAILED"):
        details.append(f"other shapes: {row.other}")
    if row.failure:
        details.append(f"FAILED: {row.failure}")
    details.extend(f"note: {n}" for n in row.notes)
    return line + "".join(f"\n    {d}" for d in details)


METHODS = ["symbolic_trace", "symbolic_trace+leaves", "traced_on_example", "traced_on_example+leaves", "module_hooks",
           "failed"]


def summary(rows: list[Row]) -> str:
    counts: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        counts[row.family]["failed" if row.failure and row.method == "-" else row.method] += 1
    lines = ["", "Summary: capture method per family",
             f"{'family':<14}" + "".join(f"{m:>26}" for m in METHODS)]
    for family, c in counts.items():
        lines.append(f"{family:<14}" + "".join(f"{c[m]:>26}" for m in METHODS))
    total = Counter()
    for c in counts.values():
        total.update(c)
    lines.append(f"{'all':<14}" + "".join(f"{total[m]:>26}" for m in METHODS))
    equal = sum(1 for r in rows if r.out_eq.startswith("yes") and r.grad_eq.startswith("yes"))
    lines.append(f"outputs and gradients equal to the uninstrumented model's in train mode: {equal}/{len(rows)}")
    other = sum(1 for r in rows if r.other.startswith("="))
    own = sum(1 for r in rows if r.other == "= own")
    lines.append(f"equal on inputs of other shapes: {other}/{len(rows)} ({own} of them through the model's own "
                 "forward, a guard having failed)")
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2-3 models per family, no experiments")
    parser.add_argument("--no-experiments", action="store_true", help="skip the capture experiments")
    parser.add_argument("--no-dynamo", action="store_true", help="experiments without torch._dynamo.export (slow on "
                                                                 "some models: minutes on 2 CPU cores)")
    parser.add_argument("--only", default="", help="a substring: run only models whose name contains it")
    options = parser.parse_args()

    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, threads {torch.get_num_threads()}, "
          f"batch {BATCH}, images 3x{IMAGE}x{IMAGE} unless noted, text {SEQ} tokens (vocab {VOCAB})")

    rows: list[Row] = []
    kept: list[tuple[Spec, Row, nn.Module, tuple[Any, ...], dict[str, Any]]] = []
    print(header())
    for family, package, specs in FAMILIES:
        if importlib.util.find_spec(package) is None:
            print(f"[{family}: package '{package}' is not installed, skipped]")
            continue
        module = __import__(package)
        try:
            family_specs = specs()
        except Exception as error:
            print(f"[{family} {getattr(module, '__version__', '?')}: could not list models: {short_error(error)}]")
            continue
        print(f"[{family} {getattr(module, '__version__', '?')}]")
        for spec in family_specs:
            if options.quick and not spec.quick:
                continue
            if options.only and options.only.lower() not in spec.name.lower():
                continue
            row, model, args, kwargs = run_model(spec)
            if spec.note:
                row.notes.insert(0, spec.note)
            rows.append(row)
            print(format_row(row), flush=True)
            if model is not None and (row.leaves or row.method == "module_hooks") and not row.failure:
                kept.append((spec, row, model, args, kwargs))
            else:
                del model
    print(summary(rows))
    if not options.quick and not options.no_experiments:
        experiments(kept, dynamo=not options.no_dynamo)


# ------------------------------------------------------------------ experiments: more FX nodes than the ladder gives


def observe_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, Example]:
    """The first call each module gets in one seeded forward (and backward), recorded by a forward pre-hook."""
    calls: dict[int, Example] = {}

    def pre(module: nn.Module, a: tuple, k: dict) -> None:
        if id(module) not in calls:
            calls[id(module)] = Example.copy_of(a, k)

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    try:
        call(model, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


class HybridTimer:
    """A timer per traced subtree and module hooks on the modules left (self time)."""

    def __init__(self, root: nn.Module, traced: list[tuple[str, nn.Module, Capture]], hooked: list[nn.Module]) -> None:
        self.parts = [(module, timer_for(module, how)) for _, module, how in traced]
        self.hooks = ModuleHookTimer(root)
        # Hooks on the untraced modules, and on the roots of traced subtrees so that their time is
        # taken out of their parents' self time (their own hook node is not counted: their timer has it).
        self.hooks._modules = hooked + [module for module, _ in self.parts]
        hooked_ids = {id(m) for m in hooked}
        self.hook_indices = [self.hooks._index[id(m)] for m in self.hooks._modules if id(m) in hooked_ids]

    uses_backward_events = True

    @property
    def nodes(self) -> list[Any]:
        return [n for _, t in self.parts for n in t.nodes] + [self.hooks.nodes[i] for i in self.hook_indices]

    @property
    def fwd(self) -> list[list[int]]:
        return [f for _, t in self.parts for f in t.fwd] + [self.hooks.fwd[i] for i in self.hook_indices]

    @property
    def mismatch(self) -> str | None:
        return next((t.mismatch for _, t in self.parts if getattr(t, "mismatch", None)), None)

    def bwd_ns(self, index: int) -> list[int]:
        for _, t in self.parts:
            if index < len(t.nodes):
                return t.bwd_ns(index)
            index -= len(t.nodes)
        return self.hooks.bwd_ns(self.hook_indices[index])

    def reset(self) -> None:
        self.hooks.reset()
        for _, t in self.parts:
            t.reset()

    def add_backward(self, events: list[tuple[int, int]]) -> None:
        self.hooks.add_backward(events)
        for _, t in self.parts:
            t.add_backward(events)

    def resolve(self) -> None:
        self.hooks.resolve()
        for _, t in self.parts:
            t.resolve()

    def install(self, root: nn.Module) -> None:
        for module, t in self.parts:
            t.install(module)
        self.hooks.install(root)

    def uninstall(self, root: nn.Module) -> None:
        self.hooks.uninstall(root)
        for module, t in reversed(self.parts):
            t.uninstall(module)


def capture_tree(module: nn.Module, path: str, calls: dict[int, Example], traced: list, hooked: list,
                 reasons: dict[str, str], seen: set[int] | None = None) -> None:
    """Capture ``module`` on its own first call; if that fails, hooks on it and its children captured.

    A module shared by several parents (Bart's ``shared`` embedding is also ``encoder.embed_tokens``
    and ``decoder.embed_tokens``) is captured once: two timers installed on one module would not
    give it its own forward back when uninstalled in the order they were installed.
    """
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    if id(module) in calls:
        how = capture(module, calls[id(module)])
        if how.graph_module is not None:
            traced.append((path, module, how))
            # Leaves of this graph are captured on their own too (nested: the leaf's node in the parent
            # graph is then inclusive of the nodes of the leaf's own graph).
            for leaf in how.leaves:
                capture_tree(module.get_submodule(leaf), f"{path}.{leaf}" if path else leaf, calls, traced, hooked,
                             reasons, seen)
            return
        hooked.append(module)
        reasons[type(module).__name__] = how.error
    # not called as a whole (a ModuleList), or not traceable: its children, each on its own
    for name, child in module.named_children():
        capture_tree(child, f"{path}.{name}" if path else name, calls, traced, hooked, reasons, seen)


def check_timer(model: nn.Module, make_timer: Callable[[], Any], args: tuple, kwargs: dict, other: tuple[tuple, dict]) -> str:
    """Equality with the uninstrumented model, backward coverage and the other-shapes step, in words."""
    before = _instrumented(model)
    ref_outs, ref_grads = call(model, args, kwargs)
    try:
        timer = make_timer()
        got = timed_step(model, timer, args, kwargs)
    except Exception as error:
        return f"FAILED: {short_error(error)}"
    out_eq, grad_eq = same(ref_outs, got.outs), same_grads(ref_grads, got.grads)
    text = (f"out== {'yes' if out_eq else 'NO'}, grad== {'yes' if grad_eq else 'NO'}, bwd>0 {got.with_bwd}/{got.nodes}, "
            f"ran {got.ran}")
    if _instrumented(model) != before:
        text += f"; LEFT INSTALLED after uninstall: {sorted(_instrumented(model) - before)[:3]}"
    return f"{text}; other shapes: {other_shapes_step(model, timer, other)}"


def _instrumented(model: nn.Module) -> set[str]:
    """Modules with an instance ``forward`` or forward hooks: what a timer installs."""
    return {f"{name or '(root)'}:{kind}" for name, m in model.named_modules()
            for kind, present in (("forward", "forward" in m.__dict__), ("hooks", bool(m._forward_hooks or m._forward_pre_hooks)))
            if present}


def timed_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_timed(n))


def verdict(text: str) -> str:
    """'=' when the timed step gave the model's outputs and gradients (also on other shapes), else '!'."""
    ok = "FAILED" not in text and "NO" not in text.split(";")[0] and "other shapes: =" in text
    return "=" if ok else "!"


def experiments(kept: list[Any], dynamo: bool = True) -> None:
    print("\nExperiments: more FX nodes where the ladder keeps leaves or falls back to module hooks")
    print("  nodes: timed FX nodes (guards excluded); for the hybrid, FX nodes + hooked modules")
    print("  timed: one recorded step with the timer; other shapes: a second step, batch 3 and 12 tokens, same timer")
    table: list[tuple[str, str, dict[str, str]]] = []
    for spec, row, model, args, kwargs in kept:
        cells: dict[str, str] = {}
        table.append((spec.name, f"{row.method} {row.nodes}/{len(row.leaves)}", cells))
        print(f"\n{spec.family} {spec.name}: capture gave {row.method}, {row.nodes} timed nodes"
              + (f" ({len(row.leaves)} leaves)" if row.leaves else ""))
        other = other_inputs(spec)
        example = Example.copy_of(args, kwargs)
        if row.method == "symbolic_trace+leaves":
            start = time.perf_counter()
            got = trace_on_example(model, example)
            took = time.perf_counter() - start
            if got.graph_module is None:
                print(f"  {'on example, leaves too':<26} not traced ({took:.2f} s): {got.error}")
                cells["on example"] = "-"
            else:
                how = Capture("traced_on_example", got.graph_module, got.leaves)
                result = check_timer(model, lambda h=how, m=model: timer_for(m, h), args, kwargs, other)
                print(f"  {'on example, leaves too':<26} {timed_nodes(got.graph_module)} nodes, {len(got.leaves)} "
                      f"leaves ({took:.2f} s); timed: {result}")
                cells["on example"] = f"{timed_nodes(got.graph_module)}/{len(got.leaves)} {verdict(result)}"

        traced: list[Any] = []
        hooked: list[nn.Module] = []
        reasons: dict[str, str] = {}
        start = time.perf_counter()
        capture_tree(model, "", observe_calls(model, args, kwargs), traced, hooked, reasons)
        took = time.perf_counter() - start
        fx_nodes = sum(timed_nodes(how.graph_module) for _, _, how in traced)
        leaves = [f"{p}.{leaf}" if p else leaf for p, _, how in traced for leaf in how.leaves]
        print(f"  {'per-child (hybrid)':<26} {len(traced)} graphs ({shorten_names([p or '(root)' for p, _, _ in traced], 3)}), "
              f"{fx_nodes} FX nodes + {len(hooked)} hooked modules = {fx_nodes + len(hooked)} nodes "
              f"(was {row.nodes}) ({took:.2f} s)")
        if leaves:
            print(f"    {'':<24} leaves inside subtrees: {shorten_names(leaves)}")
        for kind, reason in reasons.items():
            print(f"    {'':<24} hooked, not traceable alone: {kind}: {reason[:150]}")
        result = check_timer(model, lambda m=model, t=traced, h=hooked: HybridTimer(m, t, h), args, kwargs, other)
        print(f"    {'':<24} timed: {result}")
        cells["per-child"] = f"{fx_nodes}+{len(hooked)}/{len(leaves)} {verdict(result)}"

        if not dynamo:
            continue
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exported = torch._dynamo.export(model)(*args, **kwargs).graph_module
            took = time.perf_counter() - start
            result = check_timer(model, lambda e=exported: NodeTimer(e), args, kwargs, other)
            print(f"  {'dynamo export':<26} {timed_nodes(exported)} nodes ({took:.2f} s); timed: {result}")
            cells["dynamo"] = f"{timed_nodes(exported)} {verdict(result)} {took:.0f}s"
        except Exception as error:
            print(f"  {'dynamo export':<26} failed ({time.perf_counter() - start:.2f} s): {short_error(error)}")
            cells["dynamo"] = "failed"
        finally:
            torch._dynamo.reset()
    columns = ["on example", "per-child", "dynamo"]
    print("\nExperiments summary: timed nodes/leaves per variant (hybrid: FX nodes+hooked modules/leaves); '=' outputs "
          "and gradients equal on both input shapes, '!' not; '-' not traced; dynamo: + export time")
    print(f"{'model':<32}{'today':<32}" + "".join(f"{n:<20}" for n in columns))
    for name, today, cells in table:
        print(f"{name[:31]:<32}{today[:31]:<32}" + "".join(f"{cells.get(c, '')[:19]:<20}" for c in columns))


if __name__ == "__main__":
    main()
