"""How far the capture ladder gets on real model zoos, and whether timing changes anything.

    .venv/bin/python benchmarks/model_zoo.py            # every model, then the experiments
    .venv/bin/python benchmarks/model_zoo.py --quick    # 2-3 models per family, no experiments

For each model of torchvision, timm and HuggingFace transformers (built small from its class or
config, never with downloaded weights; a family whose package is missing is skipped with a
note), on CPU, in train mode:

1. ``capture(model)`` (``fxprof_lightning.capture``) and the timer the callback would pick for
   it (``FXProfilerCallback._timer_for``): ``NodeTimer(capture.graph_module)`` when there is a
   graph, else ``ModuleHookTimer(model)``;
2. one reference forward + backward of the uninstrumented model (seeded), then two timed
   forward + backward with the timer installed (same seed), exactly as in a warm-up and a recorded
   step (``reset``, ``install``, forward, loss = sum of the float outputs, backward, ``uninstall``,
   ``resolve``); the times shown are the second step's;
3. outputs (every tensor they hold, caches included) and parameter gradients of each timed run
   compared with ``torch.equal``. If they
   differ in train mode, the comparison is repeated in eval mode (captured again in eval mode,
   as the callback does per mode) to tell randomness (dropout, stochastic depth) from a wrong
   graph.

One row per model: the capture method, timed nodes (and how many ran), leaf modules, whether
outputs and gradients are equal, the fraction of nodes with backward time (of all nodes, and of
the nodes whose forward created autograd nodes, i.e. that should have one), the summed forward
and backward node times, the capture time. Leaves and errors follow the row. A summary counts
capture methods per family.

The experiments (full run; ``--no-experiments`` to skip them, ``--no-dynamo`` to skip the slow
last one) try ways the capture ladder could keep FX node granularity where it falls back today,
on the models that did not trace whole (prototypes in this file; the package is not changed):

* ``concrete_args only`` / ``unwrap only`` / ``observed``: record the calls each module really gets
  (a forward pre-hook, ``with_kwargs``), then trace the forward (``unwrap``: its innermost function,
  ``inspect.unwrap``, past decorators such as HF's ``merge_with_config_defaults``/``can_return_tuple``)
  through a generated wrapper with an explicit signature (the named parameters plus every
  ``**kwargs`` key seen), giving (``concrete``) every argument that holds no tensor and was the
  same in every call (None, bools, ints, strings) as ``concrete_args``: tensors stay
  placeholders, ``if attention_mask is not None`` sees the real value. Objects the graph needs as
  arguments (an HF config) become constant attributes; a dict subclass returned (HF
  ``ModelOutput``) is rebuilt with its class. The leaf ladder runs as in ``capture``.
* ``+fn-leaves``: when tracing fails inside a plain function called by name from a forward (not
  a module), that function becomes a leaf (``autowrap_functions``) instead of the whole module,
  e.g. HF ``create_causal_mask``.
* ``+values``: the tracer also runs every node on the observed example (no grad, RNG and buffers
  restored) and answers Python control flow on proxies from the example value (``bool``, ``iter``,
  ``len``, ``__index__``, ``dtype``/``device``), inserting a guard node that re-checks each such
  decision at run time; torch factory calls with proxy sizes (``torch.ones(b, s)``) are recorded.
* ``per-child``: when the root still has leaves or cannot be traced, each module is captured on
  its own (with its own observed calls) and descended into when it cannot be; traced subtrees
  get a ``NodeTimer`` each, the remaining modules module hooks (a hybrid timer).
* ``dynamo``: ``torch._dynamo.export`` with the example inputs (a torch-level graph, specialised
  on the example), timed with ``NodeTimer``.

Every variant is timed with ``FixedNodeTimer`` (``NodeTimer`` with two fixes these graphs need; the
first traced variant and dynamo's graph are also tried with ``NodeTimer`` as it is) and checked
like the models above (outputs and gradients equal), then again on inputs of other shapes
(batch 3, 12 tokens) with the same timer, to see whether specialising on one example breaks
later steps; and the model must have its own forward back, no hook left, after ``uninstall``.
A last table sums it up.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import inspect
import logging
import operator
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
from fxprof_lightning.module_hooks import ModuleHookTimer
from fxprof_lightning.node_timing import NodeTimer, tensors_in

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
    """``FXProfilerCallback._timer_for``, on CPU without torch.profiler."""
    if how.graph_module is not None:
        device = next(model.parameters(), torch.empty(0)).device.type
        return NodeTimer(how.graph_module, annotate=False, device=device)
    return ModuleHookTimer(model)


@dataclass
class Timed:
    """What one timed step measured."""

    outs: list[torch.Tensor]
    grads: dict[str, Any]
    nodes: int
    ran: int  # nodes with at least one forward sample
    with_bwd: int  # nodes with a backward time > 0
    made_grad: int  # nodes whose forward created autograd nodes (a backward span)
    fwd_ms: float
    bwd_ms: float


def timed_step(model: nn.Module, timer: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int = 0) -> Timed:
    """A recorded step: reset, install, forward, loss, backward, uninstall, resolve."""
    model.zero_grad(set_to_none=True)
    timer.reset()
    timer.install(model)
    try:
        torch.manual_seed(seed)
        output = model(*args, **kwargs)
        loss = loss_of(output)
        if loss is not None:
            loss.backward()
    finally:
        timer.uninstall(model)
    timer.resolve()
    outs = [t.detach().clone() for t in output_tensors(output)]
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    bwd = [timer.bwd_ns(i) for i in range(len(timer.nodes))]
    return Timed(outs, grads, len(timer.nodes), sum(1 for f in timer.fwd if f), sum(1 for b in bwd if sum(b) > 0),
                 sum(1 for spans in timer.bwd if spans), sum(map(sum, timer.fwd)) / 1e6, sum(map(sum, bwd)) / 1e6)


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
    out_eq: str = "-"
    grad_eq: str = "-"
    bwd: str = "-"
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    capture_s: float = 0.0
    error: str = ""  # Capture.error (why tracing the whole module failed)
    failure: str = ""  # an exception of this script's run (build, forward, ...)
    notes: list[str] = field(default_factory=list)


def short(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:240]}"


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
        how = capture(model)
        row.capture_s = time.perf_counter() - start
        row.method, row.leaves, row.error = how.method, dict(how.leaves), how.error
        timer = timer_for(model, how)
        got = timed_step(model, timer, args, kwargs)
        again = timed_step(model, timer, args, kwargs)  # the recorded step after a warm-up one, as scheduled
        row.nodes, row.ran, row.fwd_ms, row.bwd_ms = again.nodes, again.ran, again.fwd_ms, again.bwd_ms
        row.bwd = f"{again.with_bwd}/{again.nodes} ({again.with_bwd}/{again.made_grad})"
        out_eq = same(ref_outs, got.outs) and same(ref_outs, again.outs)
        grad_eq = same_grads(ref_grads, got.grads) and same_grads(ref_grads, again.grads)
        row.out_eq, row.grad_eq = ("yes" if out_eq else "NO"), ("yes" if grad_eq else "NO")
        if not (out_eq and grad_eq):
            # Same seed, and a different result: is it randomness in train mode, or the graph?
            again_outs, again_grads = call(model, args, kwargs)
            deterministic = same(ref_outs, again_outs) and same_grads(ref_grads, again_grads)
            row.notes.append("train mode: the uninstrumented model itself gives " +
                             ("the same result twice with the same seed" if deterministic else
                              "different results with the same seed (non-deterministic kernels)"))
            model.eval()
            eval_ref_outs, eval_ref_grads = call(model, args, kwargs)
            eval_how = capture(model)
            eval_got = timed_step(model, timer_for(model, eval_how), args, kwargs)
            e_out, e_grad = same(eval_ref_outs, eval_got.outs), same_grads(eval_ref_grads, eval_got.grads)
            row.out_eq += f"/eval {'yes' if e_out else 'NO'}"
            row.grad_eq += f"/eval {'yes' if e_grad else 'NO'}"
            model.train()
    except Exception as error:  # one model's failure must not stop the run
        row.failure = short(error)
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


COLUMNS = [("source", 12), ("model", 34), ("params", 7), ("capture", 21), ("nodes", 5), ("ran", 5), ("leaves", 6),
           ("out==", 11), ("grad==", 11), ("bwd>0: all (grad-making)", 24), ("fwd ms", 8), ("bwd ms", 8),
           ("cap s", 6)]


def header() -> str:
    line = " ".join(f"{name:<{width}}" for name, width in COLUMNS)
    return line + "\n" + "-" * len(line)


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.0f}k"


def format_row(row: Row) -> str:
    values = [row.family, row.model, fmt_params(row.params), row.method, row.nodes, row.ran, len(row.leaves),
              row.out_eq, row.grad_eq, row.bwd, f"{row.fwd_ms:.1f}", f"{row.bwd_ms:.1f}", f"{row.capture_s:.2f}"]
    line = " ".join(f"{str(v)[:w]:<{w}}" for v, (_, w) in zip(values, COLUMNS))
    details = []
    if row.leaves:
        details.append(f"leaves: {shorten_names(list(row.leaves))}")
        reasons = Counter(row.leaves.values())
        details.extend(f"  leaf reason (x{c}): {r}" for r, c in reasons.most_common(3))
    if row.error and (row.method == "module_hooks" or not row.leaves):
        details.append(f"error: {row.error}")
    if row.failure:
        details.append(f"FAILED: {row.failure}")
    details.extend(f"note: {n}" for n in row.notes)
    return line + "".join(f"\n    {d}" for d in details)


def summary(rows: list[Row]) -> str:
    methods = ["symbolic_trace", "symbolic_trace+leaves", "module_hooks", "failed"]
    counts: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        counts[row.family]["failed" if row.failure and row.method == "-" else row.method] += 1
    lines = ["", "Summary: capture method per family", f"{'family':<14}" + "".join(f"{m:>23}" for m in methods)]
    for family, c in counts.items():
        lines.append(f"{family:<14}" + "".join(f"{c[m]:>23}" for m in methods))
    total = Counter()
    for c in counts.values():
        total.update(c)
    lines.append(f"{'all':<14}" + "".join(f"{total[m]:>23}" for m in methods))
    equal = sum(1 for r in rows if r.out_eq.startswith("yes") and r.grad_eq.startswith("yes"))
    lines.append(f"outputs and gradients equal to the uninstrumented model's in train mode: {equal}/{len(rows)}")
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
            print(f"[{family} {getattr(module, '__version__', '?')}: could not list models: {short(error)}]")
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
            if model is not None and row.method != "symbolic_trace" and not row.failure:
                kept.append((spec, row, model, args, kwargs))
            else:
                del model
    print(summary(rows))
    if not options.quick and not options.no_experiments:
        experiments(kept, dynamo=not options.no_dynamo)


# ------------------------------------------------------------------ experiments: keeping FX granularity


class Unsupported(Exception):
    """The observed call cannot be expressed as an explicit signature."""


def observe_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, list[tuple[tuple, dict]]]:
    """Every call each module gets in one seeded forward (and backward), by a forward pre-hook."""
    calls: dict[int, list[tuple[tuple, dict]]] = defaultdict(list)

    def pre(module: nn.Module, a: tuple, k: dict) -> None:
        calls[id(module)].append((a, dict(k)))

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    try:
        call(model, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, type(Ellipsis))


def _is_plain(value: Any) -> bool:
    """None, bools, numbers, strings, dtypes, devices and containers of them: safe to specialise on.

    Any other object (an HF ``Cache``, a config) stays a placeholder: baked into the graph, a
    mutable object would be the one seen at trace time, not the one of the call.
    """
    return all(isinstance(leaf, PLAIN) for leaf in torch.utils._pytree.tree_leaves(value))


def _is_tensor_free(value: Any) -> bool:
    return not any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(value))


def _same_value(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and (a is b or bool(a == b))
    except Exception:
        return a is b


def explicit_forward(module: nn.Module, calls: list[tuple[tuple, dict]], unwrap: bool, concrete: bool) -> tuple[Callable, dict[str, Any] | None, dict[str, Any]]:
    """A ``forward`` with an explicit signature for the calls observed, its ``concrete_args``, the first call's values.

    The signature is that of the (unwrapped) forward, ``*args`` dropped (it must be empty in every
    call), each ``**kwargs`` key seen made a keyword parameter. The function is built with the
    globals of the original forward, so ``autowrap_functions`` patches the names it uses.
    ``concrete_args``: every argument whose value is plain (``_is_plain``) and the same in every call.
    """
    fn = inspect.unwrap(type(module).forward) if unwrap else type(module).forward
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]
    bound_calls = [sig.bind(module, *a, **k).arguments for a, k in calls]
    positional, keyword, call_pos, call_kw = [], [], [], []
    defaults: dict[str, Any] = {}
    values: dict[str, list[Any]] = {}
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            if any(b.get(p.name) for b in bound_calls):
                raise Unsupported(f"*{p.name} is used")
            continue
        if p.kind is p.VAR_KEYWORD:
            keys = sorted({key for b in bound_calls for key in b.get(p.name, {})})
            for key in keys:
                defaults[key] = None
                keyword.append(f"{key}=_d[{key!r}]")
                call_kw.append(f"{key}={key}")
                values[key] = [b.get(p.name, {}).get(key) for b in bound_calls]
            continue
        if p.default is not p.empty:
            defaults[p.name] = p.default
        text = f"{p.name}=_d[{p.name!r}]" if p.default is not p.empty else p.name
        (keyword if p.kind is p.KEYWORD_ONLY else positional).append(text)
        # By keyword where possible: a decorator's (*args, **kwargs) wrapper then sees what a caller passes.
        if p.kind is p.POSITIONAL_ONLY:
            call_pos.append(p.name)
        else:
            call_kw.append(f"{p.name}={p.name}")
        values[p.name] = [b.get(p.name, p.default) for b in bound_calls]
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = (f"def _make(_fn, _d):\n    def forward({signature}):\n"
              f"        return _fn({', '.join(['self', *call_pos, *call_kw])})\n    return forward\n")
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    made = namespace["_make"](fn, defaults)
    forward = type(made)(made.__code__, fn.__globals__, "forward", made.__defaults__, made.__closure__)
    forward.__kwdefaults__ = made.__kwdefaults__
    examples = {name: seen[0] for name, seen in values.items()}
    if not concrete:
        return forward, None, examples
    concrete_args = {}
    for name, seen in values.items():
        first = seen[0]
        if all(_is_tensor_free(v) or isinstance(v, torch.Tensor) for v in seen) and isinstance(first, torch.Tensor):
            continue  # a tensor: a placeholder
        if all(_same_value(v, first) for v in seen) and _is_plain(first):
            concrete_args[name] = first
        # Anything else (a tuple of tensors, a cache object) stays one placeholder: ``cos, sin = pe``
        # unpacks a proxy. (A tuple given as (PH, PH) would make fx use _PyTreeCodeGen, whose
        # generated forward is invalid Python when placeholders have defaults: "self, x = None, ... =".)
    return forward, concrete_args, examples


def _holds_proxy(obj: Any, depth: int = 5, seen: set[int] | None = None) -> bool:
    """Whether ``obj`` refers to an ``fx.Proxy`` through its attributes and containers (a few levels)."""
    seen = set() if seen is None else seen
    if isinstance(obj, fx.Proxy):
        return True
    if depth == 0 or id(obj) in seen or isinstance(obj, (*PLAIN, torch.Tensor, nn.Module, type)):
        return False
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return any(_holds_proxy(item, depth - 1, seen) for item in items)


class ObservedTracer(fx.Tracer):
    """``capture``'s ``_LeafTracer`` plus function leaves, and constants for objects fx cannot take as arguments."""

    def __init__(self, leaves: set[str], functions: tuple[Callable, ...]) -> None:
        super().__init__(autowrap_functions=functions)
        self.extra_leaves = leaves
        self.failed_in: str | None = None
        self.constants: dict[int, str] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.extra_leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                try:
                    self.failed_in = self.path_of_module(m)
                except NameError:
                    self.failed_in = ""
            raise

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and type(a) is not dict and not isinstance(a, fx.immutable_collections.immutable_dict):
            # A dict subclass (HF ModelOutput) built in the forward: rebuild it, keep its class.
            return self.create_node("call_function", type(a), (), {k: self.create_arg(v) for k, v in a.items()})
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            return self._constant(a)  # fx would call the constructor again with the fields (an HF config)
        try:
            return super().create_arg(a)
        except NotImplementedError:  # any other object: a constant attribute
            return self._constant(a)

    def _constant(self, a: Any) -> Any:
        if _holds_proxy(a):  # e.g. an HF DynamicCache built in the forward and filled with traced values
            raise fx.proxy.TraceError(f"a {type(a).__name__} built while tracing holds traced values: it cannot be "
                                      "a constant of the graph")
        name = self.constants.get(id(a))
        if name is None:
            name = self.constants[id(a)] = f"_fxprof_constant_{len(self.constants)}"
            setattr(self.root, name, a)
        return self.create_node("get_attr", name, (), {})


def culprit_function(error: BaseException, forward_codes: set[Any]) -> Callable | None:
    """The plain function, called by name from a module's forward, that tracing failed in (else None)."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].f_code in forward_codes:
            break
    else:
        return None
    if i + 1 >= len(frames):
        return None
    callee = frames[i + 1].f_code
    candidate = frames[i].f_globals.get(callee.co_name)
    if callable(candidate) and not isinstance(candidate, type) and not isinstance(candidate, nn.Module):
        code = getattr(candidate, "__code__", None)
        if code is callee or getattr(inspect.unwrap(candidate), "__code__", None) is callee:
            return candidate
    return None


_MISSING = object()


def _guard(value: Any, expected: Any, what: str) -> None:
    """Runs in the graph: the Python decision taken at trace time must still hold."""
    if what.startswith("len("):
        value = len(value)
    elif what.startswith("int("):
        value = operator.index(value)
    else:
        value = bool(value)
    if value != expected:
        raise RuntimeError(f"fxprof: the traced graph was specialised on {what} == {expected!r}, which no longer holds")


def _guard_attribute(value: Any, attribute: str, expected: Any) -> None:
    """Runs in the graph: a tensor attribute read as a constant at trace time must not have changed."""
    if getattr(value, attribute) != expected:
        raise RuntimeError(f"fxprof: the traced graph was specialised on .{attribute} == {expected!r}")


class ValueProxy(fx.Proxy):
    """A proxy whose static tensor attributes (dtype, device, ndim, ...) are read from the example, with a guard.

    ``torch.finfo(x.dtype)``, ``x.to(device=y.device)`` in Python code outside torch functions,
    ``if x.dtype == torch.float16``: the constant is used, and the graph checks it at run time.
    """

    STATIC = ("dtype", "device", "layout", "ndim", "is_cuda", "is_sparse", "is_quantized", "is_meta")

    def __getattr__(self, k: str) -> Any:
        if k in ValueProxy.STATIC:
            value = self.tracer.value_of(self)
            if isinstance(value, torch.Tensor):
                constant = getattr(value, k)
                self.tracer.guards += 1
                self.tracer.create_proxy("call_function", _guard_attribute, (self, k, constant), {})
                return constant
        return super().__getattr__(k)

    def __index__(self) -> int:
        """``torch.ones(batch, seq)``, ``range(n)``: the example's int, guarded (specialises that size)."""
        value = self.tracer.value_of(self)
        if not isinstance(value, int):
            raise fx.proxy.TraceError(f"no int example value for {self.node.format_node()}")
        self.tracer.guards += 1
        self.tracer.create_proxy("call_function", _guard, (self, value, f"int({self.node.name})"), {})
        return value


FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint")


class ValueTracer(ObservedTracer):
    """``ObservedTracer`` that also runs every node on the observed example (no grad, RNG and buffers restored).

    Python control flow on a proxy (``bool``, ``iter``, ``len``) is answered from the example value,
    and a guard node (``_guard``) that checks the same decision at run time is put into the graph:
    ``if x.dim() == 2``, ``bsz, seq = x.shape``, ``for h in hidden`` and ``query.shape[2] > 1`` trace.
    (A value computed from data, ``if mask.any()``, is specialised the same way, guarded.) Proxies are
    ``ValueProxy``: static attributes (dtype, device) and ints used as Python ints (``__index__``) are
    constants of the example, guarded too.
    """

    def __init__(self, leaves: set[str], functions: tuple[Callable, ...], examples: dict[str, Any]) -> None:
        super().__init__(leaves, functions)
        clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
        self.examples = {k: torch.utils._pytree.tree_map(clone, v) for k, v in examples.items()}
        self.values: dict[fx.Node, Any] = {}
        self.proxy_buffer_attributes = True  # self.position_ids[:, :seq_len]: the buffer is a node too
        self.computing = False
        self.guards = 0

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ValueProxy(node, self)

    def value_of(self, proxy: fx.Proxy) -> Any:
        return self.values.get(proxy.node, _MISSING)

    def _concrete(self, tree: Any) -> Any:
        missing = []

        def one(x: Any) -> Any:
            if isinstance(x, fx.Proxy):
                v = self.value_of(x)
                if v is _MISSING:
                    missing.append(x)
                return v
            return x

        out = fx.node.map_aggregate(tree, one)
        return _MISSING if missing else out

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **more: Any) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
        value = _MISSING
        if kind == "placeholder":
            value = self._placeholder_value(target)
        elif kind == "get_attr":
            self.computing = True  # Module.__getattr__ is patched: plain attributes while we look
            try:
                value = operator.attrgetter(target)(self.root)
            except AttributeError:
                pass
            finally:
                self.computing = False
        elif kind in ("call_function", "call_method", "call_module"):
            a, k = self._concrete(args), self._concrete(kwargs)
            if a is not _MISSING and k is not _MISSING:
                self.computing = True
                try:
                    with torch.no_grad():
                        if kind == "call_function":
                            value = target(*a, **k)
                        elif kind == "call_method":
                            value = getattr(a[0], target)(*a[1:], **k)
                        else:
                            value = self.root.get_submodule(target).forward(*a, **k)
                except Exception:
                    value = _MISSING
                finally:
                    self.computing = False
        if value is not _MISSING:
            self.values[proxy.node] = value
        return proxy

    def _placeholder_value(self, name: str) -> Any:
        if name in self.examples:
            return self.examples[name]
        base, _, index = name.rpartition("_")
        if base in self.examples and index.isdigit():  # a PH inside concrete_args: the index-th leaf
            leaves = torch.utils._pytree.tree_leaves(self.examples[base])
            if int(index) - 1 < len(leaves):
                return leaves[int(index) - 1]
        return _MISSING

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self.computing:  # a leaf module run for its value: plain eager code
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self.computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _known(self, obj: fx.Proxy, what: str) -> Any:
        value = self.value_of(obj)
        if value is _MISSING:
            raise fx.proxy.TraceError(f"no example value for {obj.node.format_node()} ({what})")
        return value

    def to_bool(self, obj: fx.Proxy) -> bool:
        decision = bool(self._known(obj, "bool"))
        self.guards += 1
        self.create_proxy("call_function", _guard, (obj, decision, obj.node.name), {})
        return decision

    def iter(self, obj: fx.Proxy) -> Any:
        value = self._known(obj, "iter")
        if not isinstance(value, (tuple, list, torch.Size)):
            raise fx.proxy.TraceError(f"cannot iterate over {type(value).__name__}")
        self.guards += 1
        self.create_proxy("call_function", _guard, (obj, len(value), f"len({obj.node.name})"), {})
        return iter([obj[i] for i in range(len(value))])

    def length(self, obj: fx.Proxy) -> int:
        size = len(self._known(obj, "len"))
        self.guards += 1
        self.create_proxy("call_function", _guard, (obj, size, f"len({obj.node.name})"), {})
        return size

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        buffers = {name: b.detach().clone() for name, b in root.named_buffers()} if isinstance(root, nn.Module) else {}
        original_len = fx.Proxy.__len__
        tracer = self

        def proxy_len(proxy: fx.Proxy) -> int:
            return tracer.length(proxy) if proxy.tracer is tracer else original_len(proxy)

        def factory(original: Callable) -> Callable:
            # torch.ones(batch, seq) with proxies for sizes never reaches __torch_function__: record it here
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                found = []
                fx.node.map_aggregate((args, kwargs), lambda x: found.append(x) if isinstance(x, fx.Proxy) else None)
                if found and not self.computing:
                    return self.create_proxy("call_function", original, args, kwargs)
                return original(*args, **kwargs)
            return wrapper

        factories = {name: getattr(torch, name) for name in FACTORIES}
        fx.Proxy.__len__ = proxy_len
        for name, original in factories.items():
            setattr(torch, name, factory(original))
        try:
            with torch.random.fork_rng(devices=[]):
                return super().trace(root, concrete_args)
        finally:
            fx.Proxy.__len__ = original_len
            for name, original in factories.items():
                setattr(torch, name, original)
            with torch.no_grad():
                for name, b in root.named_buffers() if buffers else []:
                    if name in buffers:
                        b.copy_(buffers[name])


@dataclass
class Observed:
    """What ``trace_observed`` got."""

    graph_module: fx.GraphModule | None
    leaves: dict[str, str]
    functions: list[str]
    error: str = ""
    guards: int = 0


def trace_observed(module: nn.Module, calls: list[tuple[tuple, dict]], unwrap: bool = True, concrete: bool = True,
                   function_leaves: bool = True, values: bool = False) -> Observed:
    """The capture ladder on the forward built by ``explicit_forward`` (see the module docstring)."""
    try:
        forward, concrete_args, examples = explicit_forward(module, calls, unwrap, concrete)
    except Exception as error:
        return Observed(None, {}, [], f"signature: {short(error)}")
    forward_codes = {inspect.unwrap(type(m).forward).__code__ for m in module.modules()}
    forward_codes |= {type(m).forward.__code__ for m in module.modules() if hasattr(type(m).forward, "__code__")}
    forward_codes.add(forward.__code__)
    original = type(module)
    leaves: dict[str, str] = {}
    functions: list[Callable] = []
    first_error = ""
    for _ in range(MAX_TRIES):
        tracer = (ValueTracer(set(leaves), tuple(functions), examples) if values else
                  ObservedTracer(set(leaves), tuple(functions)))
        module.__class__ = type(original.__name__, (original,), {"forward": forward, "__module__": original.__module__})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = tracer.trace(module, concrete_args=concrete_args)
            keep_argument_names(graph, concrete_args)
            graph_module = fx.GraphModule(tracer.root, graph, class_name=original.__name__)
            return Observed(graph_module, leaves, [f.__name__ for f in functions], first_error,
                            getattr(tracer, "guards", 0))
        except Exception as error:
            first_error = first_error or short(error)
            culprit = culprit_function(error, forward_codes) if function_leaves else None
            if culprit is not None and culprit not in functions:
                functions.append(culprit)
                continue
            if tracer.failed_in and tracer.failed_in not in leaves:
                leaves[tracer.failed_in] = short(error)
                continue
            return Observed(None, leaves, [f.__name__ for f in functions], short(error))
        finally:
            module.__class__ = original
            for name in tracer.constants.values():
                module.__dict__.pop(name, None)
    return Observed(None, leaves, [f.__name__ for f in functions], "too many retries")


MAX_TRIES = 64


def keep_argument_names(graph: fx.Graph, concrete_args: dict[str, Any] | None) -> None:
    """Give a specialised argument its own name back (fx names it ``name_1``), so callers can pass it by keyword.

    Needed when no argument is a container (then fx uses the plain codegen, whose ``forward`` takes the
    placeholder names); with ``_PyTreeCodeGen`` the signature already has the original names.
    """
    if not concrete_args or isinstance(graph._codegen, fx.graph._PyTreeCodeGen):
        return
    taken = {n.name for n in graph.nodes}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        base, _, index = node.target.rpartition("_")
        if index == "1" and base in concrete_args and base not in taken:
            node.target = base
            node._rename(base)
            taken.add(base)


def placeholders_first(gm: fx.GraphModule) -> None:
    """Move every placeholder before the first other node (``concrete_args`` interleaves asserts with them)."""
    first_other = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    late = []
    seen_other = False
    for node in gm.graph.nodes:
        seen_other = seen_other or node.op != "placeholder"
        if seen_other and node.op == "placeholder":
            late.append(node)
    for node in late:
        first_other.prepend(node)
    if late:
        gm.recompile()


class FixedNodeTimer(NodeTimer):
    """``NodeTimer`` with two fixes these graphs need (``NodeTimer._instrument`` assumes neither):

    * placeholders are not all at the top (``concrete_args`` puts an ``_assert_is_none``/``_assert``
      after each specialised one): they are moved first, else ``copies[n]`` raises ``KeyError``;
    * the graph's codegen is kept (``_PyTreeCodeGen`` of a ``torch._dynamo.export`` graph), else
      the instrumented ``forward`` takes flat positional inputs and returns a flat output.
    """

    def _instrument(self, traced: fx.GraphModule, annotate: bool) -> fx.GraphModule:
        placeholders_first(traced)
        instrumented = super()._instrument(traced, annotate)
        instrumented.graph._codegen = copy.deepcopy(traced.graph._codegen)
        instrumented.recompile()
        return instrumented


class HybridTimer:
    """A ``NodeTimer`` per traced subtree and module hooks on the modules left (self time)."""

    def __init__(self, root: nn.Module, traced: list[tuple[str, nn.Module, fx.GraphModule]], hooked: list[nn.Module]) -> None:
        self.parts = [(module, FixedNodeTimer(gm)) for _, module, gm in traced]
        self.hooks = ModuleHookTimer(root)
        # Hooks on the untraced modules, and on the roots of traced subtrees so that their time is
        # taken out of their parents' self time (their own hook node is not counted: the NodeTimer has it).
        self.hooks._modules = hooked + [module for module, _ in self.parts]
        hooked_ids = {id(m) for m in hooked}
        self.hook_indices = [self.hooks._index[id(m)] for m in self.hooks._modules if id(m) in hooked_ids]

    @property
    def nodes(self) -> list[Any]:
        return [n for _, t in self.parts for n in t.nodes] + [self.hooks.nodes[i] for i in self.hook_indices]

    @property
    def fwd(self) -> list[list[int]]:
        return [f for _, t in self.parts for f in t.fwd] + [self.hooks.fwd[i] for i in self.hook_indices]

    @property
    def bwd(self) -> list[Any]:
        return [b for _, t in self.parts for b in t.bwd] + [self.hooks.bwd[i] for i in self.hook_indices]

    def bwd_ns(self, index: int) -> list[int]:
        return [sum(span.samples) for span in self.bwd[index] if span.samples]

    def reset(self) -> None:
        self.hooks.reset()
        for _, t in self.parts:
            t.reset()

    def resolve(self) -> None:
        pass

    def install(self, root: nn.Module) -> None:
        for module, t in self.parts:
            t.install(module)
        self.hooks.install(root)

    def uninstall(self, root: nn.Module) -> None:
        self.hooks.uninstall(root)
        for module, t in reversed(self.parts):
            t.uninstall(module)


def capture_tree(module: nn.Module, path: str, calls: dict[int, list], traced: list, hooked: list,
                 values: bool = False, reasons: dict[str, str] | None = None, seen: set[int] | None = None) -> None:
    """Capture ``module`` on its own (``trace_observed``); if that fails, hooks on it and its children captured.

    A module shared by several parents (Bart's ``shared`` embedding is also ``encoder.embed_tokens``
    and ``decoder.embed_tokens``) is captured once: two timers installed on one module would not
    give it its own forward back when uninstalled in the order they were installed.
    """
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    if id(module) in calls:
        # No unwrap: the decorators' own logic (HF use_cache from the config) runs as in eager mode.
        got = trace_observed(module, calls[id(module)], unwrap=False, values=values)
        if got.graph_module is not None:
            traced.append((path, module, got))
            # Leaves of this graph are captured on their own too (nested: the leaf's node in the parent
            # graph is then inclusive of the nodes of the leaf's own graph).
            for leaf in got.leaves:
                capture_tree(module.get_submodule(leaf), f"{path}.{leaf}" if path else leaf, calls, traced, hooked,
                             values, reasons, seen)
            return
        hooked.append(module)
        if reasons is not None:
            reasons[type(module).__name__] = got.error
    # not called as a whole (a ModuleList), or not traceable: its children, each on its own
    for name, child in module.named_children():
        capture_tree(child, f"{path}.{name}" if path else name, calls, traced, hooked, values, reasons, seen)


def check_timer(model: nn.Module, make_timer: Callable[[], Any], args: tuple, kwargs: dict,
                other: tuple[tuple, dict] | None = None) -> str:
    """Equality with the uninstrumented model and backward coverage of one timed step, in words.

    ``other``: inputs of other shapes (batch 3, 12 tokens) for a second step with the same timer: does
    a graph specialised on the first example still give the model's result, or stop at a guard?
    """
    before = _instrumented(model)
    text = _check_once(model, make_timer, args, kwargs)
    if _instrumented(model) != before:
        text += f"; LEFT INSTALLED after uninstall: {sorted(_instrumented(model) - before)[:3]}"
    if other is not None and not text.startswith(("building", "timed step FAILED")):
        ref_outs, ref_grads = call(model, *other)
        try:
            got = timed_step(model, _check_once.timer, *other)
            ok = same(ref_outs, got.outs) and same_grads(ref_grads, got.grads)
            text += f"; other shapes: {'equal' if ok else 'NOT EQUAL'}"
        except Exception as error:
            text += f"; other shapes: FAILED {short(error)[:110]}"
    return text


def _instrumented(model: nn.Module) -> set[str]:
    """Modules with an instance ``forward`` or forward hooks: what a timer installs."""
    return {f"{name or '(root)'}:{kind}" for name, m in model.named_modules()
            for kind, present in (("forward", "forward" in m.__dict__), ("hooks", bool(m._forward_hooks or m._forward_pre_hooks)))
            if present}


def _check_once(model: nn.Module, make_timer: Callable[[], Any], args: tuple, kwargs: dict) -> str:
    ref_outs, ref_grads = call(model, args, kwargs)
    try:
        timer = _check_once.timer = make_timer()
    except Exception as error:
        return f"building the timer FAILED: {short(error)}"
    try:
        got = timed_step(model, timer, args, kwargs)
    except Exception as error:
        return f"timed step FAILED: {short(error)}"
    out_eq, grad_eq = same(ref_outs, got.outs), same_grads(ref_grads, got.grads)
    return (f"out== {'yes' if out_eq else 'NO'}, grad== {'yes' if grad_eq else 'NO'}, "
            f"bwd>0 {got.with_bwd}/{got.nodes} ({got.with_bwd}/{got.made_grad} grad-making), ran {got.ran}")


GUARDS = (_guard, _guard_attribute, fx._symbolic_trace._assert_is_none, torch._assert)


def timed_nodes(gm: fx.GraphModule, guards: bool = True) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")
               and (guards or n.target not in GUARDS))


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


def verdict(text: str) -> str:
    """``g<nodes that created autograd nodes>`` and '=' when the timed step gave the model's outputs and
    gradients (and did on other shapes), else '!'."""
    made = re.search(r"/(\d+) grad-making\)", text)
    ok = not ("FAILED" in text or "NO" in text.split(";")[0] or "NOT EQUAL" in text)
    return (f"g{made.group(1)} " if made else "") + ("=" if ok else "!")


def experiments(kept: list[Any], dynamo: bool = True) -> None:
    print("\nExperiments: keeping FX node granularity where the ladder falls back (models above that did not "
          "trace whole)")
    print("  nodes: timed FX nodes (call_module/call_function/call_method), guards and asserts included; for the "
          "hybrid, FX nodes + hooked modules")
    print("  timed: one recorded step with the timer; other shapes: a second step, batch 3 and 12 tokens, same timer")
    table: list[tuple[str, str, dict[str, str]]] = []
    for spec, row, model, args, kwargs in kept:
        cells: dict[str, str] = {}
        method = {"symbolic_trace": "st", "symbolic_trace+leaves": "st+leaves", "module_hooks": "hooks"}[row.method]
        made = re.search(r"\((\d+)/(\d+)\)", row.bwd)
        table.append((spec.name, f"{method} {row.nodes}/{len(row.leaves)} g{made.group(2) if made else '?'}", cells))
        print(f"\n{spec.family} {spec.name}: capture gave {row.method}, {row.nodes} timed nodes"
              + (f" ({len(row.leaves)} leaves)" if row.leaves else ""))
        try:
            calls = observe_calls(model, args, kwargs)
        except Exception as error:
            print(f"  observing calls failed: {short(error)}")
            continue
        root_calls = calls[id(model)]
        other = other_inputs(spec)
        variants = [("concrete_args only", dict(unwrap=False, concrete=True, function_leaves=False)),
                    ("unwrap only", dict(unwrap=True, concrete=False, function_leaves=False)),
                    ("observed (unwrap+concrete)", dict(unwrap=True, concrete=True, function_leaves=False)),
                    ("observed+fn-leaves", dict(unwrap=True, concrete=True, function_leaves=True)),
                    ("observed+values", dict(unwrap=True, concrete=True, function_leaves=False, values=True)),
                    ("concrete+values (no unwrap)", dict(unwrap=False, concrete=True, function_leaves=False, values=True)),
                    ("observed+values+fn-leaves", dict(unwrap=True, concrete=True, function_leaves=True, values=True))]
        best: dict[bool, Observed | None] = {False: None, True: None}
        as_is_shown = False
        for label, options in variants:
            start = time.perf_counter()
            got = trace_observed(model, root_calls, **options)
            took = time.perf_counter() - start
            if got.graph_module is None:
                print(f"  {label:<28} root not traced ({took:.2f} s): {got.error}"
                      + (f"; leaves so far: {shorten_names(list(got.leaves))}" if got.leaves else ""))
                cells[label] = "-"
                continue
            gm = got.graph_module
            text = f"  {label:<28} traced, {timed_nodes(gm)} nodes, {len(got.leaves)} leaves ({took:.2f} s)"
            if timed_nodes(gm, guards=False) != timed_nodes(gm):
                text += f", {timed_nodes(gm) - timed_nodes(gm, guards=False)} of them guards/asserts"
            if got.leaves:
                text += f": {shorten_names(list(got.leaves))} [{Counter(got.leaves.values()).most_common(1)[0][0][:160]}]"
            if got.functions:
                text += f"; function leaves: {', '.join(sorted(set(got.functions)))}"
            print(text)
            best[options.get("values", False)] = got
            if label.startswith("observed") and not as_is_shown:
                as_is_shown = True
                print(f"    {'':<26} NodeTimer as it is: {check_timer(model, lambda gm=gm: NodeTimer(gm), args, kwargs)}")
            result = check_timer(model, lambda gm=gm: FixedNodeTimer(gm), args, kwargs, other)
            print(f"    {'':<26} timed (fixed NodeTimer): {result}")
            cells[label] = f"{timed_nodes(gm)}/{len(got.leaves)} {verdict(result)}"
        for values in (False, True):
            label = "per-child+values (hybrid)" if values else "per-child (hybrid)"
            if best[values] is not None and not best[values].leaves:
                cells[label] = "(whole)"
                continue  # the whole model traced: nothing to gain per child
            traced: list[Any] = []
            hooked: list[nn.Module] = []
            start = time.perf_counter()
            reasons: dict[str, str] = {}
            capture_tree(model, "", calls, traced, hooked, values=values, reasons=reasons)
            took = time.perf_counter() - start
            fx_nodes = sum(timed_nodes(o.graph_module) for _, _, o in traced)
            leaves = [f"{p}.{leaf}" if p else leaf for p, _, o in traced for leaf in o.leaves]
            functions = sorted({f for _, _, o in traced for f in o.functions})
            print(f"  {label:<28} {len(traced)} graphs ({shorten_names([p or '(root)' for p, _, _ in traced], 3)}), "
                  f"{fx_nodes} FX nodes + {len(hooked)} hooked modules = {fx_nodes + len(hooked)} nodes "
                  f"(was {row.nodes}) ({took:.2f} s)")
            if leaves:
                print(f"    {'':<26} leaves inside subtrees: {shorten_names(leaves)}")
            if functions:
                print(f"    {'':<26} function leaves: {', '.join(functions)}")
            if hooked:
                print(f"    {'':<26} hooked (not traceable alone): {shorten_names([type(m).__name__ for m in hooked], 6)}")
                for kind, reason in reasons.items():
                    print(f"    {'':<28}{kind}: {reason[:150]}")
            parts = [(p, m, o.graph_module) for p, m, o in traced]
            result = check_timer(model, lambda m=model, p=parts, h=hooked: HybridTimer(m, p, h), args, kwargs, other)
            print(f"    {'':<26} timed: {result}")
            cells[label] = f"{fx_nodes}+{len(hooked)}/{len(leaves)} {verdict(result)}"
        if not dynamo:
            continue
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exported = torch._dynamo.export(model)(*args, **kwargs).graph_module
            took = time.perf_counter() - start
            shared = {id(p) for p in model.parameters()} >= {id(p) for p in exported.parameters()}
            print(f"  {'dynamo export':<28} {timed_nodes(exported)} nodes ({took:.2f} s), parameters shared with the "
                  f"model: {shared}")
            as_is = check_timer(model, lambda e=exported: NodeTimer(e), args, kwargs)
            print(f"    {'':<26} NodeTimer as it is: {as_is}")
            result = check_timer(model, lambda e=exported: FixedNodeTimer(e), args, kwargs, other)
            print(f"    {'':<26} timed (fixed NodeTimer): {result}")
            cells["dynamo"] = f"{timed_nodes(exported)} {verdict(result)} {took:.0f}s"
        except Exception as error:
            print(f"  {'dynamo export':<28} failed ({time.perf_counter() - start:.2f} s): {short(error)}")
            cells["dynamo"] = "failed"
        finally:
            torch._dynamo.reset()
    columns = ["observed (unwrap+concrete)", "observed+fn-leaves", "observed+values", "observed+values+fn-leaves",
               "concrete+values (no unwrap)", "per-child (hybrid)", "per-child+values (hybrid)", "dynamo"]
    short_names = ["observed", "+fn-leaves", "+values", "+values+fn", "values no-unwrap", "per-child", "per-child+val",
                   "dynamo"]
    print("\nExperiments summary: timed nodes/leaves per variant (hybrid: FX nodes+hooked modules/leaves), "
          "gN: N nodes created autograd nodes (compute granularity: guards, shape and getattr nodes excluded);")
    print("'=' outputs and grads equal on both input shapes, '!' not; '-' root not traced; (whole): not needed, "
          "the whole model traced; dynamo: + export time")
    print(f"{'model':<32}{'today':<21}" + "".join(f"{n:<18}" for n in short_names))
    for name, today, cells in table:
        print(f"{name[:31]:<32}{today:<21}" + "".join(f"{cells.get(c, '')[:17]:<18}" for c in columns))


if __name__ == "__main__":
    main()
