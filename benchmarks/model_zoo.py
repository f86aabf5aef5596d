"""How far the capture ladder gets on models we did not write, and whether profiling changes training.

    .venv/bin/python benchmarks/model_zoo.py                  # every model, then the capture experiments
    .venv/bin/python benchmarks/model_zoo.py --quick          # a handful of models, no experiments (< 1 minute)
    .venv/bin/python benchmarks/model_zoo.py --only llama     # models whose name contains a substring
    .venv/bin/python benchmarks/model_zoo.py --all-causal-lm  # only the sweep over every HF causal LM (minutes)

Nothing is downloaded: every model is built small from its class or config, CPU only. Families whose
package is missing are skipped with a note. The first line gives the date and the versions used.

Part 1, torchvision and timm (``capture()`` on one call, as the callback does once it has recorded
the model's first call), in train mode:

1. ``capture(model, example)`` and the timer the callback picks for it (``GuardedNodeTimer`` for a
   graph traced on the example, ``NodeTimer`` for another graph, else ``ModuleHookTimer``);
2. one reference forward + backward of the uninstrumented model (seeded), then two timed forward +
   backward with the timer installed (same seed), as in a warm-up and a recorded step (loss = sum
   of the float outputs, backward times from profiler events); the times shown are the second step's;
3. outputs and parameter gradients of each timed run compared with ``torch.equal`` (repeated in eval
   mode when they differ, to tell randomness from a wrong graph);
4. one more timed step on inputs of another batch size, compared with the uninstrumented model.

One row per model (capture method, timed nodes, leaves, outputs/gradients equal, other shapes,
nodes with backward time, forward/backward ms, capture time) and a summary per family. The
experiments (full run; ``--no-experiments``, ``--no-dynamo``) try, on the models the ladder did not
capture whole, what could give more FX nodes: rung 3 also where rung 2 left leaves, each module
captured on its own first call (a hybrid timer), and ``torch._dynamo.export``.

Part 2, HuggingFace transformers, trained as users train them: a LightningModule whose
``training_step`` returns ``self.model(**batch).loss`` (dict batches with ``labels``: the input ids
for causal LMs, a class per sequence or per token for encoders, target ids for seq2seq, a class per
image or clip), SGD over the parameters that require grad, batch 2, 12 tokens with the last
sequence padded by 4 (``attention_mask``). Each model is trained by a real
``lightning.pytorch.Trainer(accelerator="cpu", max_steps=5, logger=False, ...)`` twice from the
same ``pl.seed_everything`` seed: without the callback and with
``FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=2, repeat=1, module="model")``
(torch.profiler on, as by default). Every weight of the two runs is compared bitwise
(``torch.equal``). From ``callback.cycles[0]``: ``capture.method``, the nodes, those with backward
time, ``capture.guards``, ``capture.leaves`` (and why), and the share of forward time spent in
leaves (``total_ms`` of ``call_module`` nodes whose target is a leaf, over all nodes); also the time
spent in ``capture`` and the callback's warnings that a graph does not fit a call or that module
hooks time the model. A model that fails is a row with its error, never the end of the run: a
failure without the callback is the model's ("does not run"), one with it the profiler's ("crashed").

Models come from their DEFAULT configs with only the sizes shrunk (``SMALL``: hidden 32, 2 layers,
2 heads, 1 key/value head, intermediate 64, vocabulary 128, 64 positions, head dim 16, and the
equivalent attribute names of other families), token ids outside the vocabulary moved inside it,
``num_labels=2`` for classifiers; cache, ``return_dict``, dropout and loss options are the
defaults. Both ``attn_implementation="sdpa"`` and ``"eager"`` where the model supports SDPA:

* causal LMs: GPT2, Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma2, Gemma3 (text), Phi, Phi3;
* encoders: sequence and token classification for BERT, RoBERTa, DistilBERT, DeBERTa-v2, ELECTRA;
* seq2seq: T5 (``decoder_start_token_id=0``, as t5-small), BART;
* vision: ViT, Swin, ConvNeXt (32x32 images); audio: Whisper (16 mel bins, 64 frames), Wav2Vec2
  sequence classification (400 samples, two small convolutions);
* PEFT: LoRA (r=4, q_proj and v_proj, dropout 0.05) on Llama, the base frozen, with the count of
  ``lora_A``/``lora_B`` nodes; Llama with ``gradient_checkpointing_enable()`` (its decoder layers
  are expected to be leaves: "activation checkpointing cannot be traced").

``--all-causal-lm`` sweeps instead every entry of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` with the generic shrink and its default attention, 60 s per
model (a model that does not run with 2 layers is tried with 8: hybrid models need one of their
full-attention layers); those that do not build from such a config or do not train without the
callback are listed as such (not the profiler's failures), those needing another package skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import logging
import os
import platform
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch import fx, nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxprof_lightning import FXProfilerCallback
from fxprof_lightning.capture.guarded_timer import GuardedNodeTimer
from fxprof_lightning.capture.ladder import capture
from fxprof_lightning.capture.leaves import short_error
from fxprof_lightning.capture.module_hooks import ModuleHookTimer
from fxprof_lightning.capture.recorded_call import Example
from fxprof_lightning.capture.traced_on_example import trace_on_example
from fxprof_lightning.nodes import Capture, is_timed
from fxprof_lightning.timing.autograd_walk import tensors_in
from fxprof_lightning.timing.node_timing import BackwardEvents, NodeTimer

BATCH = 2
IMAGE = 64  # CNNs: 3 x 64 x 64




# ------------------------------------------------------------------ part 1: torchvision and timm through capture()


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



FAMILIES: list[tuple[str, str, Callable[[], list[Spec]]]] = [
    ("torchvision", "torchvision", torchvision_specs),
    ("timm", "timm", timm_specs),
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
    """The spec's inputs with batch 3 (images keep their size)."""
    global BATCH
    saved = BATCH
    BATCH = 3
    try:
        torch.manual_seed(1)
        return spec.inputs()
    finally:
        BATCH = saved


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



# ------------------------------------------------------------------ HuggingFace: trained through a real Trainer

HF_SEED = 7
HF_STEPS = 5  # step 0 idle (its call is the recorded one), 1 warm-up, 2-3 recorded, 4 after the cycle
HF_BATCH, HF_SEQ, HF_LABEL_SEQ = 2, 12, 8  # the last sequence of each batch has its last 4 tokens padded
HF_SCHEDULE = {"skip_first": 0, "wait": 1, "warmup": 1, "active": 2, "repeat": 1}
HF_TIME_LIMIT_S = 120  # per model (both runs); the sweep's is SWEEP_TIME_LIMIT_S
SWEEP_TIME_LIMIT_S = 60
SWEEP_RETRY_LAYERS = 8  # hybrid models need a full-attention layer, which 2 layers of their pattern may not have
SWEEP_MAX_PARAMS = 20_000_000  # a sweep model still bigger after the shrink is not built (counted on the meta device)

# The sizes every text config is shrunk to: set where the default config has the attribute itself (not through
# attribute_map) with an int value (None too for MAY_BE_NONE), never raised above the default. Multi-head latent
# attention configs (kv_lora_rank) get a key/value head per head and head_dim = qk_rope_head_dim.
# Sub-configs (text_config, vision_config, ...) are shrunk the same way.
SMALL = {
    "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 64, "max_position_embeddings": 64, "head_dim": 16,
    "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "n_ctx": 64, "n_inner": 64,  # GPT-2 style
    "d_model": 32, "d_ff": 64, "d_kv": 16, "num_layers": 2, "num_heads": 2, "ffn_dim": 64,  # T5 / OPT style
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_target_positions": 64,  # BART style
    "dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64,  # DistilBERT style
    "embedding_size": 32, "pooler_hidden_size": 32, "num_kv_heads": 1, "rotary_dim": 8, "ffn_hidden_size": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,  # MoE
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,  # MLA
}
MAY_BE_NONE = {"head_dim", "num_key_value_heads", "num_experts_per_tok"}
LAYER_COUNTS = {"num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "n_layers"}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}


def shrunk_config(config_cls: type, layers: int = 2, **fixed: Any) -> Any:
    """``config_cls``'s default config with ``SMALL``'s sizes (``layers`` layers), token ids moved into the
    vocabulary, and ``fixed``."""
    default = config_cls()
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    kwargs: dict[str, Any] = {}
    for key, small in SMALL.items():
        small = layers if key in LAYER_COUNTS else small
        value = default.__dict__.get(key, "absent") if key not in aliases else "absent"
        if value is None and key in MAY_BE_NONE:
            kwargs[key] = small
        elif isinstance(value, int) and not isinstance(value, bool):
            kwargs[key] = min(value, small)
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:
        # Multi-head latent attention: a key/value head per head, the head size that of the rotary part.
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", SMALL["num_attention_heads"])
        kwargs["head_dim"] = kwargs.get("qk_rope_head_dim", kwargs.get("head_dim"))
    vocab = kwargs.get("vocab_size", getattr(default, "vocab_size", None))
    if isinstance(vocab, int):
        for key, inside in TOKEN_IDS.items():
            value = getattr(default, key, None)
            if isinstance(value, int) and value >= vocab:
                kwargs[key] = inside
            elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
                kwargs[key] = [v if v < vocab else inside for v in value]
    for name in getattr(config_cls, "sub_configs", None) or {}:
        sub = getattr(default, name, None)
        if sub is not None and name not in fixed:
            kwargs[name] = shrunk_config(type(sub), layers)
    return config_cls(**{**kwargs, **fixed})


Batch = dict[str, torch.Tensor]
MakeBatch = Callable[[Any, torch.Generator], Batch]  # (the model's config, a generator) -> one batch


def padded_text(config: Any, generator: torch.Generator) -> Batch:
    vocab = config.get_text_config().vocab_size
    input_ids = torch.randint(3, vocab, (HF_BATCH, HF_SEQ), generator=generator)
    attention_mask = torch.ones(HF_BATCH, HF_SEQ, dtype=torch.long)
    attention_mask[-1, HF_SEQ - 4:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def text_batch(labels: str) -> MakeBatch:
    """Token ids, a padded attention mask and ``labels``: "lm" (the input ids), "sequence" (one class per
    sequence), "token" (one class per token) or "seq2seq" (target token ids)."""

    def make(config: Any, generator: torch.Generator) -> Batch:
        batch = padded_text(config, generator)
        vocab = config.get_text_config().vocab_size
        batch["labels"] = {
            "lm": lambda: batch["input_ids"],
            "sequence": lambda: torch.randint(0, 2, (HF_BATCH,), generator=generator),
            "token": lambda: torch.randint(0, 2, (HF_BATCH, HF_SEQ), generator=generator),
            "seq2seq": lambda: torch.randint(3, vocab, (HF_BATCH, HF_LABEL_SEQ), generator=generator),
        }[labels]()
        return batch

    return make


def image_batch(config: Any, generator: torch.Generator) -> Batch:
    return {"pixel_values": torch.randn(HF_BATCH, 3, config.image_size, config.image_size, generator=generator),
            "labels": torch.randint(0, 2, (HF_BATCH,), generator=generator)}


def whisper_batch(config: Any, generator: torch.Generator) -> Batch:
    frames = 2 * config.max_source_positions  # the encoder's two convolutions halve it
    return {"input_features": torch.randn(HF_BATCH, config.num_mel_bins, frames, generator=generator),
            "labels": torch.randint(3, config.vocab_size, (HF_BATCH, HF_LABEL_SEQ), generator=generator)}


def waveform_batch(config: Any, generator: torch.Generator) -> Batch:
    return {"input_values": torch.randn(HF_BATCH, 400, generator=generator),
            "labels": torch.randint(0, 2, (HF_BATCH,), generator=generator)}


@dataclass
class HFSpec:
    """An HF model to train: ``build(attention)`` (None: the config's default attention) and its batches."""

    family: str
    name: str
    build: Callable[[str | None], nn.Module]
    batch: MakeBatch
    attentions: tuple[str | None, ...]
    quick: bool = False
    fallback: HFSpec | None = None  # the sweep: the same model with more layers, tried when this one does not run


def attentions_of(model_cls: type) -> tuple[str | None, ...]:
    """Both implementations where the model supports SDPA, else eager only."""
    return ("sdpa", "eager") if getattr(model_cls, "_supports_sdpa", False) else ("eager",)


def hf(family: str, model_name: str, batch: MakeBatch, quick: bool = False, sizes: dict[str, Any] | None = None,
       attentions: tuple[str | None, ...] | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
       name: str = "", **fixed: Any) -> HFSpec:
    """A spec for ``transformers.<model_name>``: its config class's default config shrunk (``shrunk_config``), or
    built from ``sizes`` alone (vision and audio configs, whose sizes are lists), plus ``fixed``."""
    import transformers

    model_cls = getattr(transformers, model_name, None)  # None: not in this version; its build says so

    def build(attention: str | None) -> nn.Module:
        if model_cls is None:
            raise AttributeError(f"transformers {transformers.__version__} has no {model_name}")
        extra = {**fixed, **({"attn_implementation": attention} if attention else {})}
        config_cls = model_cls.config_class
        config = config_cls(**sizes, **extra) if sizes is not None else shrunk_config(config_cls, **extra)
        model = model_cls(config)
        return wrap(model) if wrap is not None else model

    return HFSpec(family, name or model_name, build, batch,
                  attentions if attentions is not None else attentions_of(model_cls), quick)


def causal_lm_specs() -> list[HFSpec]:
    lm = text_batch("lm")
    names = ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
             "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM"]
    return [hf("causal LM", name, lm, quick=name == "LlamaForCausalLM") for name in names]


def encoder_specs() -> list[HFSpec]:
    extra = {"num_labels": 2}
    return [hf(f"encoder, {task} classification", f"{stem}For{kind}Classification", text_batch(task),
               quick=stem == "Bert" and task == "sequence", **extra)
            for task, kind in (("sequence", "Sequence"), ("token", "Token"))
            for stem in ("Bert", "Roberta", "DistilBert", "DebertaV2", "Electra")]


def seq2seq_specs() -> list[HFSpec]:
    seq2seq = text_batch("seq2seq")
    return [hf("seq2seq", "T5ForConditionalGeneration", seq2seq, quick=True, decoder_start_token_id=0),  # as t5-small
            hf("seq2seq", "BartForConditionalGeneration", seq2seq)]


def vision_specs() -> list[HFSpec]:
    vit = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 64}
    swin = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [2, 2],
            "window_size": 4}
    convnext = {"image_size": 32, "num_stages": 2, "hidden_sizes": [16, 32], "depths": [2, 2]}
    return [hf("vision", "ViTForImageClassification", image_batch, quick=True, sizes=vit, num_labels=2),
            hf("vision", "SwinForImageClassification", image_batch, sizes=swin, num_labels=2),
            hf("vision", "ConvNextForImageClassification", image_batch, sizes=convnext, attentions=(None,),
               num_labels=2)]


def audio_specs() -> list[HFSpec]:
    whisper = {"vocab_size": 128, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
               "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_mel_bins": 16,
               "max_source_positions": 32, "max_target_positions": 64,
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
    wav2vec2 = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16,
                "num_conv_pos_embedding_groups": 2, "classifier_proj_size": 16}
    return [hf("audio", "WhisperForConditionalGeneration", whisper_batch, sizes=whisper),
            hf("audio", "Wav2Vec2ForSequenceClassification", waveform_batch, sizes=wav2vec2, num_labels=2)]


def lora(model: nn.Module) -> nn.Module:
    import peft

    config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.05)
    return peft.get_peft_model(model, config)  # the base model frozen: only the adapters train


def checkpointed(model: nn.Module) -> nn.Module:
    model.gradient_checkpointing_enable()
    return model


def peft_and_checkpointing_specs() -> list[HFSpec]:
    lm = text_batch("lm")
    specs = [hf("gradient checkpointing", "LlamaForCausalLM", lm, wrap=checkpointed,
                name="LlamaForCausalLM + gradient checkpointing")]
    if importlib.util.find_spec("peft") is not None:
        specs.insert(0, hf("PEFT", "LlamaForCausalLM", lm, quick=True, wrap=lora, name="LoRA(LlamaForCausalLM)"))
    return specs


HF_FAMILIES: list[Callable[[], list[HFSpec]]] = [causal_lm_specs, encoder_specs, seq2seq_specs, vision_specs,
                                                  audio_specs, peft_and_checkpointing_specs]


# ------------------------------------------------------------------ HF: the sweep over every causal LM


class Unsupported(Exception):
    """A sweep model this environment cannot build: a missing package, remote code."""


def sweep_build(model_name: str, config_name: str, layers: int) -> Callable[[str | None], nn.Module]:
    def build(attention: str | None) -> nn.Module:
        import transformers

        try:
            model_cls, config_cls = getattr(transformers, model_name), getattr(transformers, config_name)
        except (ImportError, AttributeError) as error:
            raise Unsupported(short_error(error)) from error
        config = shrunk_config(config_cls, layers)
        try:
            with torch.device("meta"):
                params = sum(p.numel() for p in model_cls(config).parameters())
        except Exception:  # some models cannot be built on meta: the real build says more
            params = 0
        if params > SWEEP_MAX_PARAMS:
            raise ValueError(f"{params / 1e6:.0f}M parameters after the generic shrink (limit "
                             f"{SWEEP_MAX_PARAMS / 1e6:.0f}M)")
        return model_cls(config)

    return build


def causal_lm_sweep_specs() -> list[HFSpec]:
    """Every (config, model) pair of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, the config's default attention; one
    that does not run with 2 layers is tried with ``SWEEP_RETRY_LAYERS``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    specs, seen = [], set()
    for model_type, model_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_name = CONFIG_MAPPING_NAMES.get(model_type, "?")
        if (config_name, model_name) in seen:
            continue
        seen.add((config_name, model_name))
        name = f"{model_name} ({model_type})"
        retry = HFSpec("all causal LMs", name, sweep_build(model_name, config_name, SWEEP_RETRY_LAYERS),
                       text_batch("lm"), (None,))
        specs.append(HFSpec("all causal LMs", name, sweep_build(model_name, config_name, 2), text_batch("lm"), (None,),
                            fallback=retry))
    return specs


# ------------------------------------------------------------------ HF: one model, trained twice


class LitHF(pl.LightningModule):
    """How HF models are trained: ``self.model(**batch).loss``, SGD over the parameters that train."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        if loss is None:
            raise ValueError(f"{type(self.model).__name__} returned no loss for labels {tuple(batch['labels'].shape)}")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class ModelTimeout(BaseException):
    """A model over its time limit (a BaseException: neither the callback nor the model may catch it)."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise ModelTimeout(f"over the time limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning, the callback's summary and kineto print to stdout/stderr: kept out of the tables."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


@dataclass
class HFRow:
    family: str
    model: str
    attention: str = "-"
    method: str = "-"
    nodes: int = 0
    with_bwd: int = 0
    guards: int = 0
    leaves: dict[str, str] = field(default_factory=dict)
    leaf_pct: float = 0.0
    equal: str = "-"  # every weight bitwise equal after training with and without the callback
    capture_s: float | None = None
    seconds: float = 0.0
    lora_nodes: int | None = None
    warnings: list[str] = field(default_factory=list)
    outcome: str = "ran"  # "ran", "crashed" (with the callback), "does not run" (without it), "skipped"
    error: str = ""
    notes: list[str] = field(default_factory=list)


FALLBACK = re.compile(r"does not fit the graph|module_hooks")
NOTEWORTHY = re.compile(r"does not fit the graph|module_hooks|FLOPs not counted|profiling stops|failed|could not")
ROUTINE = re.compile(r"has no logger|could not trace \w+ whole, so it is timed by traced_on_example")


def callback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The callback's warnings that say something about this model: a graph that did not fit, module hooks, ..."""
    texts = [" ".join(str(w.message).split()) for w in caught if "FXProfilerCallback" in str(w.message)]
    return [t for t in dict.fromkeys(texts) if NOTEWORTHY.search(t) and not ROUTINE.search(t)]


def train(spec: HFSpec, attention: str | None, callbacks: list[pl.Callback]) -> LitHF:
    """One seeded fit of ``HF_STEPS`` steps; the batches are the same in every run."""
    pl.seed_everything(HF_SEED, verbose=False)
    lit = LitHF(spec.build(attention))
    generator = torch.Generator().manual_seed(0)
    batches = [spec.batch(lit.model.config, generator) for _ in range(HF_STEPS)]
    trainer = pl.Trainer(accelerator="cpu", max_steps=HF_STEPS, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, logger=False, callbacks=callbacks)
    trainer.fit(lit, DataLoader(batches, batch_size=None))
    return lit


def bitwise_equal(plain: nn.Module, profiled: nn.Module) -> tuple[bool, list[str]]:
    a, b = plain.state_dict(), profiled.state_dict()
    differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    return a.keys() == b.keys() and not differ, differ


def read_cycle(row: HFRow, callback: Any) -> None:
    """What the callback's first cycle says: capture method, nodes, guards, leaves and their share of forward time."""
    if not callback.cycles:
        row.notes.append("no cycle was recorded")
        return
    cycle = callback.cycles[0]
    how = cycle.capture
    row.method, row.guards, row.leaves = how.method, how.guards, dict(how.leaves)
    row.capture_s = sum(how.capture_s) if how.capture_s else None
    row.nodes = len(cycle.nodes)
    row.with_bwd = sum(1 for n in cycle.nodes if n.bwd_calls > 0)
    total = sum(n.total_ms for n in cycle.nodes)
    in_leaves = sum(n.total_ms for n in cycle.nodes if n.op == "call_module" and n.target in row.leaves)
    row.leaf_pct = 100 * in_leaves / total if total else 0.0
    if "LoRA" in row.model:
        row.lora_nodes = sum(1 for n in cycle.nodes if "lora_A" in n.target or "lora_B" in n.target)
    if how.method == "module_hooks" and how.error:
        row.notes.append(f"why: {how.error}")


def run_hf(spec: HFSpec, attention: str | None, limit_s: int) -> HFRow:
    """Train ``spec`` twice from the same seed, without and with the callback; compare; read the cycle."""
    row = HFRow(spec.family, spec.name, attention or "-")
    start = time.perf_counter()
    stage = "build"
    try:
        with time_limit(limit_s), quiet(), tempfile.TemporaryDirectory() as directory:
            actual = getattr(spec.build(attention).config, "_attn_implementation", None)
            row.attention = actual if attention is None or actual == attention else f"{actual} (asked {attention})"
            stage = "without the callback"
            plain = train(spec, attention, [])
            stage = "with the callback"
            callback = FXProfilerCallback(**HF_SCHEDULE, module="model", dirpath=directory)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                profiled = train(spec, attention, [callback])
            row.warnings = callback_warnings(caught)
            equal, differ = bitwise_equal(plain, profiled)
            row.equal = "yes" if equal else "NO"
            if differ:
                row.notes.append(f"differ: {shorten_names(differ, 3)}")
            if "forward" in profiled.model.__dict__ or len(profiled.model._forward_pre_hooks) > len(
                    plain.model._forward_pre_hooks):
                row.notes.append("LEFT INSTALLED: the callback's forward or pre-hook is still on the model")
            read_cycle(row, callback)
    except (Exception, ModelTimeout) as error:
        row.error = short_error(error)
        if isinstance(error, (Unsupported, ImportError)) or re.search(r"pip install|trust_remote_code", str(error)):
            row.outcome = "skipped"
        elif stage == "with the callback":
            row.outcome = "crashed"
            where = [f for f in traceback.extract_tb(error.__traceback__) if "fxprof_lightning" in f.filename]
            if where:
                row.notes.append(f"raised in {Path(where[-1].filename).name}:{where[-1].lineno} ({where[-1].name})")
        else:
            row.outcome = "does not run"
            row.error = f"{'does not build' if stage == 'build' else 'without the callback'}: {row.error}"
    row.seconds = time.perf_counter() - start
    return row


# ------------------------------------------------------------------ HF: printing


HF_COLUMNS = [("model", 46), ("attention", 9), ("capture", 24), ("nodes", 5), ("bwd>0", 5), ("guards", 6),
              ("leaves", 28), ("leaf %fwd", 9), ("bitwise=", 8), ("cap s", 5), ("s", 5)]


def shorten_paths(paths: list[str]) -> str:
    """Module paths with layer numbers folded: ``model.layers.* x2``."""
    groups = Counter(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", p) for p in paths)
    return ", ".join(f"{g} x{c}" if c > 1 else g for g, c in groups.most_common())


def hf_header(title: str) -> str:
    line = " ".join(f"{name:<{width}}" for name, width in HF_COLUMNS) + " notes"
    return f"\n{title}\n{line}\n{'-' * len(line)}"


def hf_notes(row: HFRow) -> list[str]:
    notes = list(row.notes)
    if row.lora_nodes is not None:
        notes.insert(0, f"{row.lora_nodes} nodes in lora_A/lora_B")
    if row.leaves:
        notes.extend(f"leaf reason (x{c}): {r}" for r, c in Counter(row.leaves.values()).most_common(3))
    for text in row.warnings:  # the capture warning repeats the "why" above: its first words are enough
        cut = text.find("timed by module_hooks") if row.method == "module_hooks" else -1
        notes.append(f"warning: {text[:cut + len('timed by module_hooks')] + ' (why above)' if cut >= 0 else text[:200]}")
    if row.error:
        notes.append(f"{row.outcome.upper()}: {row.error}")
    return notes


def format_hf_row(row: HFRow) -> str:
    ran = row.outcome == "ran"
    leaves = f"{len(row.leaves)}: {shorten_paths(list(row.leaves))}" if row.leaves else "0"
    values = [row.model, row.attention, row.method if ran else row.outcome,
              row.nodes if ran else "-", row.with_bwd if ran else "-", row.guards if ran else "-",
              leaves if ran else "-", f"{row.leaf_pct:.1f}" if ran else "-", row.equal,
              f"{row.capture_s:.2f}" if row.capture_s is not None else "-", f"{row.seconds:.1f}"]
    line = " ".join(f"{str(v)[:w]:<{w}}" for v, (_, w) in zip(values, HF_COLUMNS))
    notes = hf_notes(row)
    return line + (" " + notes[0] if notes else "") + "".join(f"\n{'':>8}{n}" for n in notes[1:])


def hf_summary(rows: list[HFRow]) -> str:
    ran = [r for r in rows if r.outcome == "ran"]
    methods = Counter(r.method for r in ran)
    outcomes = Counter(r.outcome for r in rows)
    fallback = [r for r in ran if any(FALLBACK.search(w) for w in r.warnings)]
    other = [r for r in ran if any(not FALLBACK.search(w) for w in r.warnings)]
    lines = [f"\nSummary of {len(rows)} HuggingFace rows (model x attention):",
             "  capture method: " + ", ".join(f"{m} {methods[m]}" for m in METHODS[:-1] if methods[m]),
             f"  weights bitwise equal with and without the callback: {sum(r.equal == 'yes' for r in ran)}/{len(ran)}",
             f"  crashed with the callback: {outcomes['crashed']}"
             + "".join(f"\n    {r.model} [{r.attention}]: {r.error}" for r in rows if r.outcome == "crashed"),
             f"  does not build or run without the callback (not the profiler's): {outcomes['does not run']}",
             f"  skipped (extra packages, remote code): {outcomes['skipped']}",
             f"  with leaves: {sum(1 for r in ran if r.leaves)}",
             f"  warned that a graph does not fit a call, or of module hooks: {len(fallback)}",
             f"  other callback warnings (FLOPs not counted, ...): {len(other)}"]
    return "\n".join(lines)


def run_hf_family(title: str, specs: list[HFSpec], options: argparse.Namespace, limit_s: int) -> list[HFRow]:
    rows: list[HFRow] = []
    specs = [s for s in specs if options.only.lower() in s.name.lower() and (s.quick or not options.quick)]
    if not specs:
        return rows
    print(hf_header(title), flush=True)
    for spec in specs:
        for attention in spec.attentions[:1] if options.quick else spec.attentions:
            row = run_hf(spec, attention, limit_s)
            if row.outcome == "does not run" and spec.fallback is not None:
                again = run_hf(spec.fallback, attention, limit_s)
                if again.outcome != "does not run":
                    again.notes.insert(0, f"{SWEEP_RETRY_LAYERS} layers (2 do not run: {row.error})")
                    row = again
            rows.append(row)
            print(format_hf_row(row), flush=True)
    return rows


def run_huggingface(options: argparse.Namespace) -> None:
    if importlib.util.find_spec("transformers") is None:
        print("\n[HuggingFace transformers is not installed: skipped]")
        return
    import transformers

    transformers.logging.set_verbosity_error()
    schedule = ", ".join(f"{k}={v}" for k, v in HF_SCHEDULE.items())
    print(f"\nPart 2: HuggingFace models trained by lightning.pytorch.Trainer(accelerator='cpu', max_steps={HF_STEPS}) "
          f"twice from seed {HF_SEED}, without and with FXProfilerCallback({schedule}, module='model'); batch "
          f"{HF_BATCH}, {HF_SEQ} tokens (the last sequence padded by 4), loss = model(**batch).loss. From "
          "callback.cycles[0]: capture, nodes, bwd>0 (nodes with backward time), guards, leaves, leaf %fwd (share of "
          "forward time in leaf nodes); bitwise=: every weight equal after both runs; 'cap s': seconds in capture "
          "(all attempts), 's': both runs")
    rows: list[HFRow] = []
    if options.all_causal_lm:
        specs = causal_lm_sweep_specs()
        print(f"Sweep: {len(specs)} (config, model) pairs of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, default attention, "
              f"generic shrink ({SWEEP_RETRY_LAYERS} layers where 2 do not run), {SWEEP_TIME_LIMIT_S} s each")
        rows = run_hf_family("[all causal LMs]", specs, options, SWEEP_TIME_LIMIT_S)
        for outcome in ("does not run", "skipped"):
            listed = [r for r in rows if r.outcome == outcome]
            print(f"\n{outcome} ({len(listed)}):" + "".join(f"\n  {r.model}: {r.error}" for r in listed))
    else:
        specs = [spec for family in HF_FAMILIES for spec in family()]
        for title in dict.fromkeys(spec.family for spec in specs):
            family = [spec for spec in specs if spec.family == title]
            rows += run_hf_family(f"[{title}]", family, options, HF_TIME_LIMIT_S)
    print(hf_summary(rows))


# ------------------------------------------------------------------ main


def versions() -> str:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"lightning {lightning.__version__}"]
    for package in ("torchvision", "timm", "transformers", "peft"):
        if importlib.util.find_spec(package) is not None:
            parts.append(f"{package} {getattr(__import__(package), '__version__', '?')}")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{date}; " + ", ".join(parts) + f"; {torch.get_num_threads()} threads, CPU"


def run_vision_zoo(options: argparse.Namespace) -> list[tuple[Spec, Row, nn.Module, tuple, dict]]:
    """Part 1: torchvision and timm through ``capture()``; the models kept for the experiments."""
    rows: list[Row] = []
    kept: list[tuple[Spec, Row, nn.Module, tuple[Any, ...], dict[str, Any]]] = []
    print(f"\nPart 1: torchvision and timm through capture(), batch {BATCH}, images 3x{IMAGE}x{IMAGE} unless noted")
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
            with quiet():
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
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of models, no experiments")
    parser.add_argument("--all-causal-lm", action="store_true",
                        help="only the sweep over every causal LM of transformers' auto mapping")
    parser.add_argument("--no-experiments", action="store_true", help="skip the capture experiments")
    parser.add_argument("--no-dynamo", action="store_true", help="experiments without torch._dynamo.export (slow on "
                                                                 "some models: minutes on 2 CPU cores)")
    parser.add_argument("--only", default="", help="a substring: run only models whose name contains it")
    options = parser.parse_args()

    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("transformers", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print(versions())

    kept = [] if options.all_causal_lm else run_vision_zoo(options)
    run_huggingface(options)
    if kept and not options.quick and not options.no_experiments:
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
    print("  timed: one recorded step with the timer; other shapes: a second step, batch 3, same timer")
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
