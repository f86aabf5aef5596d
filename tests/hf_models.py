"""Tiny HuggingFace transformers models built from their configs (nothing is downloaded), called the HF way
(``model(**batch)`` with a dict batch), and their batches: used by test_sound_capture.py."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

VOCAB, HIDDEN, SEQ = 64, 32, 8


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
