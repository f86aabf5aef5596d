"""Whether profiling changes training on models we did not write, and what the capture gives them.

    .venv/bin/python benchmarks/model_zoo.py                  # every model
    .venv/bin/python benchmarks/model_zoo.py --quick          # a handful of models (< 1 minute)
    .venv/bin/python benchmarks/model_zoo.py --only llama     # models whose name contains a substring
    .venv/bin/python benchmarks/model_zoo.py --all-causal-lm  # only the sweep over every HF causal LM (minutes)

Nothing is downloaded: every model is built small from its class or config, CPU only. Families whose
package is missing are skipped with a note. The first line gives the date and the versions used.
(Its part 1, torchvision and timm through the torch.fx capture, and its experiments went with that capture;
``bench_patterns.py`` trains torchvision and timm models through the Dynamo capture.)

HuggingFace transformers, trained as users train them: a LightningModule whose
``training_step`` returns ``self.model(**batch).loss`` (dict batches with ``labels``: the input ids
for causal LMs, a class per sequence or per token for encoders, target ids for seq2seq, a class per
image or clip), SGD over the parameters that require grad, batch 2, 12 tokens with the last
sequence padded by 4 (``attention_mask``). Each model is trained by a real
``lightning.pytorch.Trainer(accelerator="cpu", max_steps=5, logger=False, ...)`` twice from the
same ``pl.seed_everything`` seed: without the callback and with
``FXProfilerCallback(skip_first=0, wait=1, warmup=1, active=2, repeat=1, module="model")``
(torch.profiler on, as by default). Every weight of the two runs is compared bitwise
(``torch.equal``). From ``callback.cycles[0]``: ``capture.method``, the nodes, those with backward
time, ``capture.graphs``, ``capture.leaves`` (and why), and the share of forward time spent in
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
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxprof_lightning import FXProfilerCallback

BATCH = 2
IMAGE = 64  # CNNs: 3 x 64 x 64




# ------------------------------------------------------------------ HuggingFace: trained through a real Trainer


def short_error(error: BaseException) -> str:
    """``Type: first line`` of an exception, for reports."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:200]}"


def shorten_names(names: list[str], limit: int = 4) -> str:
    """Names with numbers folded: ``model.layers.* x2``."""
    groups = Counter(re.sub(r"\d+", "*", n) for n in names)
    parts = [f"{g} x{c}" if c > 1 else g for g, c in groups.most_common()]
    if len(parts) > limit:
        parts = [*parts[:limit], f"+{len(parts) - limit} more"]
    return ", ".join(parts)


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
    graphs: int = 0
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
ROUTINE = re.compile(r"has no logger")


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
    """What the callback's first cycle says: capture method, nodes, graphs, leaves and their share of forward time."""
    if not callback.cycles:
        row.notes.append("no cycle was recorded")
        return
    cycle = callback.cycles[0]
    how = cycle.capture
    row.method, row.graphs, row.leaves = how.method, how.graphs, dict(how.leaves)
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


HF_COLUMNS = [("model", 46), ("attention", 9), ("capture", 24), ("nodes", 5), ("bwd>0", 5), ("graphs", 6),
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
              row.nodes if ran else "-", row.with_bwd if ran else "-", row.graphs if ran else "-",
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
             "  capture method: " + ", ".join(f"{m} {n}" for m, n in methods.most_common()),
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
    print(f"\nHuggingFace models trained by lightning.pytorch.Trainer(accelerator='cpu', max_steps={HF_STEPS}) "
          f"twice from seed {HF_SEED}, without and with FXProfilerCallback({schedule}, module='model'); batch "
          f"{HF_BATCH}, {HF_SEQ} tokens (the last sequence padded by 4), loss = model(**batch).loss. From "
          "callback.cycles[0]: capture, nodes, bwd>0 (nodes with backward time), graphs (Dynamo's), leaves, leaf %fwd (share of "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of models")
    parser.add_argument("--all-causal-lm", action="store_true",
                        help="only the sweep over every causal LM of transformers' auto mapping")
    parser.add_argument("--only", default="", help="a substring: run only models whose name contains it")
    options = parser.parse_args()

    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("transformers", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print(versions())

    run_huggingface(options)


if __name__ == "__main__":
    main()
