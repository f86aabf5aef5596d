"""HuggingFace transformers models through a real Trainer: node timing from a graph traced on a recorded call.

The models are built tiny from their configs (nothing is downloaded) and called the HF way,
``model(**batch)`` with a dict batch. Every run ends with weights bitwise equal to the same
model trained without the profiler, also when a later batch does not fit the traced graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import lightning.pytorch as pl
import peft
import pytest
import torch
import transformers
from helpers import LADDER_ON_NEWER_TORCH, make_trainer, notices, read_events
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from fxprof_lightning import FXProfilerCallback, torch_api
from fxprof_lightning.capture.example_guards import GraphMismatch
from fxprof_lightning.capture.guarded_timer import GuardedNodeTimer
from fxprof_lightning.capture.ladder import capture
from fxprof_lightning.capture.recorded_call import Example

VOCAB, HIDDEN, SEQ = 64, 32, 8
# These tests are of the torch.fx ladder's tracing on a recorded call (``capture="fx"``); HuggingFace models under the
# default Dynamo capture are in test_sound_capture.py. torch.fx cannot trace an HF model whole: each says so.
pytestmark = notices("torch.fx could not trace")
ONE_CYCLE = {"skip_first": 0, "wait": 1, "warmup": 1, "active": 2, "repeat": 1, "capture": "fx"}


def tiny_bert(attention: str = "eager") -> nn.Module:
    """Eager attention: matmul, softmax, dropout nodes; "sdpa" (HF's default): one scaled_dot_product_attention."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, attn_implementation=attention)
    return transformers.BertModel(config)


def tiny_llama() -> nn.Module:
    """LlamaForCausalLM from its default config, only the sizes shrunk: ``use_cache=True``, sdpa attention."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def text_loader(lengths: tuple[int, ...] = (SEQ,) * 6, batch_size: int = 4) -> DataLoader:
    """One dict batch per entry of ``lengths`` (tokens per sequence), the last sequence of each padded."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for length in lengths:
        mask = torch.ones(batch_size, length, dtype=torch.long)
        mask[-1, length // 2:] = 0
        batches.append({"input_ids": torch.randint(3, VOCAB, (batch_size, length), generator=generator),
                        "attention_mask": mask, "labels": torch.randint(0, 2, (batch_size,), generator=generator)})
    return DataLoader(batches, batch_size=None)  # the batches as they are


class LitEncoder(pl.LightningModule):
    """A sequence classifier on an HF encoder: ``self.model(**inputs)``, a linear head on the first token."""

    def __init__(self, attention: str = "eager") -> None:
        super().__init__()
        self.model = tiny_bert(attention)
        self.head = nn.Linear(HIDDEN, 2)

    def training_step(self, batch, batch_idx):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = self.model(**inputs).last_hidden_state
        return F.cross_entropy(self.head(hidden[:, 0]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LitHF(pl.LightningModule):
    """How HF models are trained: ``self.model(**batch).loss``, the loss computed inside the model's forward."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = build()

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def lm_loader(steps: int = 6) -> DataLoader:
    """Causal LM batches: the labels are the input ids."""
    return DataLoader([{**b, "labels": b["input_ids"]} for b in text_loader((SEQ,) * steps)], batch_size=None)


def LitCausalLM() -> LitHF:
    return LitHF(tiny_llama)


def train_both(tmp_path, make_lit, loader=text_loader, steps=4, **callback_kwargs):
    """The same model trained without and with the profiler: (profiled module, callback), after
    checking that the weights are bitwise equal and nothing is left on the model."""
    pl.seed_everything(7, verbose=False)
    plain = make_lit()
    make_trainer(tmp_path / "plain", [], max_steps=steps).fit(plain, loader())
    pl.seed_everything(7, verbose=False)
    profiled = make_lit()
    callback = FXProfilerCallback(**{**ONE_CYCLE, "module": "model", "torch_profiler": False, **callback_kwargs})
    make_trainer(tmp_path / "profiled", [callback], max_steps=steps).fit(profiled, loader())
    reference = plain.state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in profiled.state_dict().items()), "training was changed"
    assert "forward" not in profiled.model.__dict__ and not profiled.model._forward_pre_hooks
    return profiled, callback


def test_bert_is_timed_node_by_node_inside_attention(tmp_path):
    # Two sequence lengths: the graph is not specialised on the length, every batch runs it.
    with pytest.warns(UserWarning, match=r"timed by traced_on_example \(torch.fx failed on the module's own forward") as caught:
        _, callback = train_both(tmp_path, LitEncoder, lambda: text_loader((SEQ, 6, SEQ, 6)))
    assert not [w for w in caught if "FLOPs not counted" in str(w.message) or "does not fit the graph" in str(w.message)]
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and cycle.capture.guards > 0
    assert "traced on a recorded call" in cycle.to_markdown()
    attention = {n.name: n for n in cycle.nodes if n.module_path == "encoder.layer.0.attention.self"}
    assert {"matmul", "softmax", "matmul_1"} <= set(attention)
    assert all(n.calls == 2 for n in attention.values())
    assert attention["matmul"].bwd_calls == 2 and attention["matmul"].bwd_mean_ms > 0
    assert attention["softmax"].bwd_calls == 2
    assert attention["matmul"].fwd_flops == 2 * 4 * 2 * SEQ * SEQ * 16  # batch 4, 2 heads, q @ k.T, head dim 16
    names = {n.name for n in cycle.nodes}
    assert "encoder_layer_1_attention_self_query" in names  # nn.Linear calls are nodes too
    assert not any(n.target.startswith("fxprof_lightning.capture.example_guards.check_") for n in cycle.nodes)  # guards are not timed
    modules = {m.path: m for m in cycle.modules}
    assert modules["encoder.layer.0.attention.self"].total_fwd_ms > 0
    tags = set(read_events(tmp_path / "profiled" / "logs" / "version_0").Tags()["scalars"])
    assert {"fxprof/forward_ms_per_step", "fxprof/backward_ms_per_step"} <= tags


@pytest.mark.parametrize("odd_step", [1, 2], ids=["in-warm-up", "in-a-recorded-step"])
def test_a_batch_the_graph_does_not_fit_runs_the_own_forward(tmp_path, odd_step):
    # SDPA attention asks ``seq_len > 1`` (is_causal): a batch of one-token sequences takes the other branch.
    lengths = tuple(1 if step == odd_step else SEQ for step in range(8))
    with pytest.warns(UserWarning, match=r"does not fit the graph traced on its first training call \(GraphMismatch"):
        _, callback = train_both(tmp_path, lambda: LitEncoder("sdpa"), lambda: text_loader(lengths), steps=8, repeat=2,
                                 torch_profiler=True)  # the failing call runs inside the trace's ranges
    first, second = callback.cycles
    if odd_step == 1:  # nothing recorded yet: the cycle goes on with module hooks
        assert first.capture.method == "module_hooks" and first.nodes
    else:  # the cycle had recorded a step with the graph: it reports nothing rather than a mix
        assert first.capture.method == "traced_on_example" and first.nodes == []
    assert second.capture.method == "module_hooks" and "stopped fitting the calls" in second.capture.error
    assert {n.name for n in second.nodes} >= {"encoder.layer.0.attention.self", "encoder.layer.0.attention.self.query"}
    assert all(cycle.trace_paths for cycle in callback.cycles)


def test_a_causal_lm_with_its_default_cache_and_labels_is_timed_node_by_node(tmp_path):
    # The default config: use_cache=True builds a DynamicCache in the forward, which the graph builds again per call;
    # the loss (labels given) is computed inside the forward. torch.profiler on, as by default.
    _, callback = train_both(tmp_path, LitCausalLM, lm_loader, torch_profiler=True)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and not cycle.capture.leaves, cycle.capture.describe()
    attention = {n.target for n in cycle.nodes if n.module_path == "model.layers.1.self_attn"}
    assert "torch.nn.functional.scaled_dot_product_attention" in attention  # HF's default attention
    assert any(n.target == "torch.cat" for n in cycle.nodes if n.module_path == "model.layers.0.self_attn")  # the cache
    loss = [n for n in cycle.nodes if "cross_entropy" in n.target]
    assert loss and loss[0].calls == 2 and loss[0].bwd_calls == 2  # the loss inside the model's forward
    assert not any("rebuild" in n.target for n in cycle.nodes)  # building the cache again is bookkeeping
    assert sum(n.bwd_calls > 0 for n in cycle.nodes) > 50 and cycle.trace_paths


def test_the_graph_gives_a_new_cache_per_call_equal_to_the_models():
    model = tiny_llama().train()
    ids = torch.randint(3, VOCAB, (2, SEQ))
    expected = model(input_ids=ids, labels=ids)
    how = capture(model, Example.copy_of((), {"input_ids": ids, "labels": ids}))
    assert how.method == "traced_on_example", how.describe()
    torch.manual_seed(0)
    first, second = (how.graph_module(input_ids=ids, labels=ids) for _ in range(2))
    assert type(first) is type(expected) and type(first.past_key_values) is type(expected.past_key_values)
    assert first.past_key_values is not second.past_key_values
    for got, want in zip(first.past_key_values.layers, expected.past_key_values.layers, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert first.past_key_values.get_seq_length() == SEQ and torch.equal(first.loss, expected.loss)


def tiny_encoder_config(cls: type) -> transformers.PretrainedConfig:
    return cls(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=32, num_labels=2)


def test_a_sequence_classifier_with_labels_is_timed_node_by_node(tmp_path):
    # BertForSequenceClassification builds CrossEntropyLoss() inside its forward when labels are given.
    build = lambda: transformers.BertForSequenceClassification(tiny_encoder_config(transformers.BertConfig))  # noqa: E731
    _, callback = train_both(tmp_path, lambda: LitHF(build))
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and not cycle.capture.leaves, cycle.capture.describe()
    (loss,) = [n for n in cycle.nodes if n.target == "torch.nn.functional.cross_entropy"]
    assert loss.module_path == "" and loss.calls == 2 and loss.bwd_calls == 2
    assert {"classifier", "bert.pooler.dense"} <= {n.target for n in cycle.nodes if n.op == "call_module"}


def test_t5_with_labels_is_timed_node_by_node(tmp_path):
    # _shift_right assigns into a tensor (shifted[..., 1:] = labels[..., :-1]): a setitem node.
    config = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # as t5-small's config
    _, callback = train_both(tmp_path, lambda: LitHF(lambda: transformers.T5ForConditionalGeneration(config)), lm_loader)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and not cycle.capture.leaves, cycle.capture.describe()
    assert any(n.target == "operator.setitem" for n in cycle.nodes)
    assert {"decoder.block.1.layer.1.EncDecAttention.q", "lm_head"} <= {n.target for n in cycle.nodes}


def image_loader(steps: int = 6) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader([{"pixel_values": torch.randn(4, 3, 16, 16, generator=generator),
                        "labels": torch.randint(0, 2, (4,), generator=generator)} for _ in range(steps)], batch_size=None)


def test_a_vision_classifier_with_labels_is_timed_node_by_node(tmp_path):
    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=2)
    _, callback = train_both(tmp_path, lambda: LitHF(lambda: transformers.ViTForImageClassification(config)),
                             image_loader)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and not cycle.capture.leaves, cycle.capture.describe()
    assert {"vit.embeddings.patch_embeddings.projection", "classifier"} <= {n.target for n in cycle.nodes}
    assert any(n.target == "torch.nn.functional.cross_entropy" for n in cycle.nodes)


def lora_llama() -> nn.Module:
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                             target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)  # the base is frozen
    return model


def test_a_lora_model_is_timed_node_by_node_with_its_adapters(tmp_path):
    # train_both checks every weight bitwise, the trained adapters included (LoRA dropout draws random numbers).
    profiled, callback = train_both(tmp_path, lambda: LitHF(lora_llama), lm_loader)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example" and not cycle.capture.leaves, cycle.capture.describe()
    prefix = "base_model.model.model.layers.{}.self_attn.q_proj"
    nodes = {n.target: n for n in cycle.nodes if n.op == "call_module"}
    for part in ("base_layer", "lora_dropout.default", "lora_A.default", "lora_B.default"):
        node = nodes[f"{prefix.format(1)}.{part}"]
        assert node.calls == 2 and node.bwd_calls == 2 and node.bwd_mean_ms > 0, part
    # In layer 0, the input (frozen embeddings) needs no gradient: only the adapters' weights get one.
    layer0 = {part: nodes[f"{prefix.format(0)}.{part}"].bwd_calls for part in ("base_layer", "lora_dropout.default",
                                                                               "lora_A.default", "lora_B.default")}
    assert layer0 == {"base_layer": 0, "lora_dropout.default": 0, "lora_A.default": 2, "lora_B.default": 2}
    prefix = prefix.format(0)
    assert {m.path for m in cycle.modules} >= {prefix, f"{prefix}.lora_A.default", f"{prefix}.lora_B.default"}
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in profiled.named_parameters() if "lora_B" in n)  # trained


def test_a_cycle_at_the_very_first_step_uses_module_hooks_and_the_next_the_recorded_call(tmp_path):
    # Step 0 is the first call the module gets: there is nothing to trace on yet.
    with pytest.warns(UserWarning, match="timed by module_hooks .* in this cycle, which starts at its first call"):
        _, callback = train_both(tmp_path, LitEncoder, steps=6, skip_first=0, wait=0, warmup=1, active=2, repeat=2)
    first, second = callback.cycles
    assert first.capture.method == "module_hooks" and first.nodes
    assert second.capture.method == "traced_on_example" and "softmax" in {n.name for n in second.nodes}


class LitValidated(LitEncoder):
    def validation_step(self, batch, batch_idx):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        self.log("val_loss", self.model(**inputs).last_hidden_state.pow(2).mean())


def test_evaluation_gets_its_own_graph_traced_on_its_own_call(tmp_path):
    callback = FXProfilerCallback(**ONE_CYCLE, module="model", torch_profiler=False, profile_validation=True)
    lit = LitValidated()
    # One epoch of 6 steps, then 6 validation batches; the sanity check's batch is the recorded eval call.
    make_trainer(tmp_path, [callback], max_steps=6, num_sanity_val_steps=1).fit(lit, text_loader(), text_loader())
    assert callback.cycles[0].capture.method == "traced_on_example"
    (val,) = callback.val_cycles
    assert val.capture.method == "traced_on_example"  # recorded in the sanity check
    nodes = {n.name: n for n in val.nodes}
    assert nodes["softmax"].calls == 2 and nodes["softmax"].bwd_calls == 0  # no autograd in validation
    assert set(callback.profiler.timers.chosen) == {True, False} and not callback.profiler.timers.waiting_for_first_call(True)


# ------------------------------------------------------------------ the rung on its own, without Lightning


def hf_models() -> dict[str, tuple]:
    """Tiny models of several HF families and a call of each (keyword arguments)."""
    ids = torch.randint(3, VOCAB, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ // 2:] = 0
    text = {"input_ids": ids, "attention_mask": mask}
    seq2seq = {**text, "decoder_input_ids": ids[:, :4]}
    small = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return {
        "bert": (tiny_bert, text),
        "gpt2": (lambda: transformers.GPT2Model(transformers.GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32,
                                                                       **small)), text),
        "t5": (lambda: transformers.T5Model(transformers.T5Config(d_model=HIDDEN, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                                                 decoder_start_token_id=0, **small)), seq2seq),
        "llama": (tiny_llama, {**text, "labels": ids}),
        "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=HIDDEN,
                                                                     num_hidden_layers=2, num_attention_heads=2,
                                                                     intermediate_size=64)),
                {"pixel_values": torch.randn(2, 3, 16, 16)}),
    }


def forward_backward(model: nn.Module, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(1)  # dropout draws the same numbers in both runs
    output = model(**kwargs)
    tensors = [v for v in output.values() if isinstance(v, torch.Tensor)]
    sum(t.float().sum() for t in tensors).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [t.detach() for t in tensors], grads


@pytest.mark.parametrize("name", list(hf_models()))
def test_graphs_traced_on_a_call_give_the_models_results(name):
    build, kwargs = hf_models()[name]
    model = build().train()
    expected = forward_backward(model, kwargs)
    how = capture(model, Example.copy_of((), kwargs))
    assert how.method == "traced_on_example" and how.guards > 0, how.describe()
    timer = GuardedNodeTimer(how.graph_module)
    timer.install(model)
    try:
        got = forward_backward(model, kwargs)
    finally:
        timer.uninstall(model)
    assert timer.mismatch is None and all(len(samples) == 1 for samples in timer.fwd)
    assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    assert "forward" not in model.__dict__


def test_a_call_the_graph_does_not_fit_gets_the_own_forward_with_the_same_random_numbers():
    model = tiny_bert("sdpa").train()  # dropout everywhere
    recorded = {"input_ids": torch.randint(3, VOCAB, (2, SEQ)), "attention_mask": torch.ones(2, SEQ, dtype=torch.long)}
    one_token = {"input_ids": torch.randint(3, VOCAB, (2, 1)), "attention_mask": torch.ones(2, 1, dtype=torch.long)}
    expected = forward_backward(model, one_token)
    reasons = []
    timer = GuardedNodeTimer(capture(model, Example.copy_of((), recorded)).graph_module, on_mismatch=reasons.append)
    timer.install(model)
    try:
        got = forward_backward(model, one_token)
        again = forward_backward(model, recorded)  # no graph any more, even for calls it fits
    finally:
        timer.uninstall(model)
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], expected[0] + expected[1], strict=True))
    assert len(reasons) == 1 and reasons[0].startswith(GraphMismatch.__name__) and timer.mismatch == reasons[0]
    assert all(not samples for samples in timer.fwd)  # what the failed call recorded is gone
    assert again[0] and "forward" not in model.__dict__


# ------------------------------------------------------------------ activation checkpointing is kept


def checkpointed_llama() -> nn.Module:
    model = tiny_llama()
    model.gradient_checkpointing_enable()  # every decoder layer: checkpoint(use_reentrant=False)
    return model


def test_gradient_checkpointed_layers_stay_whole_and_training_is_unchanged(tmp_path):
    _, callback = train_both(tmp_path, lambda: LitHF(checkpointed_llama), lm_loader)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example+leaves"
    # gradient_checkpointing_enable() hooks embed_tokens (enable_input_require_grads): kept whole so the hook runs.
    assert set(cycle.capture.leaves) == {"model.embed_tokens", "model.layers.0", "model.layers.1"}
    assert cycle.capture.leaves["model.embed_tokens"] == "has forward hooks: they run only when the module is called whole"
    assert all("activation checkpointing cannot be traced" in cycle.capture.leaves[f"model.layers.{i}"] for i in (0, 1))
    assert {"model.layers.0", "model.layers.1", "lm_head"} <= {n.target for n in cycle.nodes if n.op == "call_module"}


@LADDER_ON_NEWER_TORCH
def test_the_graph_checkpoints_and_saves_what_the_model_saves(monkeypatch):
    calls = []
    name = torch_api.NON_REENTRANT_CHECKPOINT  # (what checkpoint(use_reentrant=False) runs: its name differs by torch)
    internal = getattr(torch.utils.checkpoint, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return internal(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, name, counted)
    model = checkpointed_llama().train()
    ids = torch.randint(3, VOCAB, (2, SEQ))

    def saved_bytes_and_checkpoints() -> tuple[int, int]:
        calls.clear()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            model(input_ids=ids, labels=ids).loss.backward()
        return sum(saved), len(calls)

    eager = saved_bytes_and_checkpoints()
    how = capture(model, Example.copy_of((), {"input_ids": ids, "labels": ids}))
    timer = GuardedNodeTimer(how.graph_module)
    timer.install(model)
    try:
        graph = saved_bytes_and_checkpoints()
    finally:
        timer.uninstall(model)
    assert timer.mismatch is None and eager[1] == 2 and graph == eager


def tiny_wav2vec2() -> nn.Module:
    """Wav2Vec2 from its default config (SpecAugment on: mask_time_prob=0.05; LayerDrop: layerdrop=0.1)."""
    config = transformers.Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3],
                                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                                         classifier_proj_size=16, num_labels=2)
    return transformers.Wav2Vec2ForSequenceClassification(config)


def audio_loader(steps: int = 6) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader([{"input_values": torch.randn(2, 400, generator=generator),
                        "labels": torch.randint(0, 2, (2,), generator=generator)} for _ in range(steps)], batch_size=None)


@notices("FLOPs not counted")
def test_wav2vec2_draws_its_masks_at_every_step_and_keeps_its_layerdrop_encoder_whole(tmp_path):
    # SpecAugment draws its masks with NumPy: a graph node that draws at every call. LayerDrop picks the encoder's
    # layers at random, which no graph can express: the encoder stays one leaf, with the reason.
    _, callback = train_both(tmp_path, lambda: LitHF(tiny_wav2vec2), audio_loader)
    (cycle,) = callback.cycles
    assert cycle.capture.method == "traced_on_example+leaves"
    assert list(cycle.capture.leaves) == ["wav2vec2.encoder"]
    assert "control flow" in cycle.capture.leaves["wav2vec2.encoder"] and "rand" in cycle.capture.leaves["wav2vec2.encoder"]
    targets = {n.target for n in cycle.nodes}
    assert any(t.endswith("_compute_mask_indices") for t in targets) and "wav2vec2.feature_extractor.conv_layers.0.conv" in targets


def test_a_plain_loop_traces_a_lora_causal_lm_on_its_first_call(tmp_path):
    """Profiler without Lightning: the first call is recorded and the next cycle's graph is traced on it."""
    from fxprof_lightning import Profiler

    def run(profiled: bool) -> tuple[nn.Module, Profiler | None]:
        torch.manual_seed(0)
        model = lora_llama()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        prof = Profiler(model, wait=1, warmup=1, active=2, repeat=1, dirpath=tmp_path, sinks=[], capture="fx") if profiled else None
        with prof or contextlib.nullcontext():
            for batch in lm_loader(steps=5):
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if prof:
                    prof.step()
        return model, prof

    plain, _ = run(False)
    with pytest.warns(UserWarning, match=r"timed by traced_on_example"):
        profiled, prof = run(True)
    (cycle,) = prof.cycles
    assert cycle.steps == [2, 3] and cycle.capture.method == "traced_on_example"
    assert {"lora_A.default", "lora_B.default"} <= {n.target.rpartition("q_proj.")[2] for n in cycle.nodes}
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), profiled.state_dict().values(), strict=True))
