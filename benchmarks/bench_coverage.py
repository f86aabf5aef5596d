"""Do the node rows account for the forward and the backward a user measures? Six models through a real Trainer.

    .venv/bin/python benchmarks/bench_coverage.py               # all six models, ~1-2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_coverage.py --only gpt2   # one model

Each model trains in a subprocess of its own (Dynamo's caches and torch's threads do not leak between models), with
``torch.set_num_threads(1)``, CPU, through a ``lightning.pytorch.Trainer`` (SGD, 12 steps) with
``FXProfilerCallback(wait=2, warmup=1, active=3, repeat=2, module="model")``: torch.profiler on, default capture
(Dynamo). Models: torchvision's ResNet18 (batch 8, 3x64x64), a 2-layer LSTM (width 128, batch 8 x 32 tokens), a
2-layer PyG GCN (200 nodes, 800 edges), and HF GPT-2, Llama and BERT (sequence classification) built from
``model_zoo.shrunk_config`` with hidden 64, 4 heads, intermediate 256, vocabulary 1000 (batch 8 x 32 tokens).
Models whose package is missing are skipped.

The LightningModule measures each step on the user's side: the model call inside ``training_step`` (forward), and
``on_before_backward`` to ``on_after_backward`` (backward), keyed by ``trainer.global_step`` (the step number the
cycle's ``steps`` hold). Of the two training cycles the first holds the capture (and Dynamo's first calls), so the
table reads the last cycle, and divides its per-step times by the mean user-side time of the same recorded steps:

* node rows: ``forward_ms_per_step`` / measured forward, ``backward_ms_per_step`` / measured backward;
* node rows + named rows (``CycleReport.unowned()``: forward between the rows; backward of autograd nodes no row
  made, and the autograd engine's rest), over the same.

Goal: >= 0.9. A second table puts the cycle's own walls (``forward_wall_ms``, ``backward_wall_ms``) next to the
user-side measures: rows + named rows add up to those walls by construction.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import logging
import os
import platform
import subprocess
import sys
import time
import warnings

import lightning
import torch
from run_info import closing_lines, cpu_stall_us, package_state, quiet_stderr

from fxprof_lightning.report import UNOWNED_ENGINE, UNOWNED_FORWARD, UNOWNED_OUTSIDE

STEPS = 12
MODELS = {"mlp6": None, "autoencoder": None, "resnet18": "torchvision", "lstm": None, "gcn": "torch_geometric", "gpt2": "transformers",
          "llama": "transformers", "bert": "transformers"}
NAMED = {UNOWNED_FORWARD: "fwd between rows", UNOWNED_OUTSIDE: "bwd no row made", UNOWNED_ENGINE: "bwd engine"}


def build(name: str):
    """(model, batches, loss of (timed call, batch)) for ``name``."""
    from torch import nn
    from torch.nn import functional as F

    g = torch.Generator().manual_seed(0)
    if name == "resnet18":
        import torchvision

        batches = [(torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(STEPS)]
        return torchvision.models.resnet18(num_classes=10), batches, lambda call, b: F.cross_entropy(call(b[0]), b[1])
    if name == "mlp6":  # six Linear layers with ReLUs between: the small model of the README's quickstart
        layers = [nn.Linear(256 if i else 64, 256) for i in range(5)]
        model = nn.Sequential(*(m for layer in layers for m in (layer, nn.ReLU())), nn.Linear(256, 10))
        batches = [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(STEPS)]
        return model, batches, lambda call, b: F.cross_entropy(call(b[0]), b[1])
    if name == "autoencoder":  # Lightning's examples/pytorch/autoencoder: 28x28 images through 64 and 3 units and back
        model = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3),
                              nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
        batches = [(torch.rand(32, 28 * 28, generator=g),) for _ in range(STEPS)]
        return model, batches, lambda call, b: F.mse_loss(call(b[0]), b[0])
    if name == "lstm":
        class LSTMNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb, self.lstm = nn.Embedding(1000, 64), nn.LSTM(64, 128, num_layers=2, batch_first=True)
                self.head = nn.Linear(128, 1000)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.lstm(self.emb(x))[0])

        batches = [tuple(torch.randint(0, 1000, (8, 32), generator=g) for _ in range(2)) for _ in range(STEPS)]
        return LSTMNet(), batches, lambda call, b: F.cross_entropy(call(b[0]).reshape(-1, 1000), b[1].reshape(-1))
    if name == "gcn":
        from torch_geometric.nn import GCNConv

        class GCN(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.c1, self.c2 = GCNConv(16, 32), GCNConv(32, 4)

            def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
                return self.c2(F.relu(self.c1(x, edges)), edges)

        graph = (torch.randn(200, 16, generator=g), torch.randint(0, 200, (2, 800), generator=g),
                 torch.randint(0, 4, (200,), generator=g))
        return GCN(), [graph] * STEPS, lambda call, b: F.cross_entropy(call(b[0], b[1]), b[2])
    import transformers
    from model_zoo import SMALL, shrunk_config

    SMALL.update({"vocab_size": 1000, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "intermediate_size": 256, "n_embd": 64, "n_head": 4, "n_inner": 256, "head_dim": 16})
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "bert": transformers.BertForSequenceClassification}[name]
    model = cls(shrunk_config(cls.config_class, **({"num_labels": 2} if name == "bert" else {})))
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(3, 1000, (8, 32), generator=g)
        labels = torch.randint(0, 2, (8,), generator=g) if name == "bert" else ids
        batches.append({"input_ids": ids, "attention_mask": torch.ones(8, 32, dtype=torch.long), "labels": labels})
    return model, batches, lambda call, b: call(**b).loss


def child(name: str) -> dict:
    """Train ``name`` with the callback; the last cycle's numbers and the user-side times of its steps."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from fxprof_lightning import FXProfilerCallback

    torch.set_num_threads(1)
    torch.manual_seed(0)
    fwd, bwd = {}, {}

    class Lit(pl.LightningModule):
        def __init__(self, model, loss) -> None:
            super().__init__()
            self.model, self.loss = model, loss

        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            out = self.model(*args, **kwargs)
            fwd[self.global_step] = 1e3 * (time.perf_counter() - start)
            return out

        def training_step(self, batch, batch_idx):
            return self.loss(self.timed, batch)

        def on_before_backward(self, loss) -> None:
            self.started = time.perf_counter()

        def on_after_backward(self) -> None:
            bwd[self.global_step] = 1e3 * (time.perf_counter() - self.started)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    model, batches, loss = build(name)
    callback = FXProfilerCallback(wait=2, warmup=1, active=3, repeat=2, module="model")
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), quiet_stderr(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        trainer.fit(Lit(model, loss), DataLoader(batches, batch_size=None))
    c = [c for c in callback.cycles if c.stage == "train"][-1]
    cap = c.capture
    short = "none" if cap is None else cap.method
    if cap is not None and cap.method == "dynamo":
        short += f", {cap.graphs} graph(s), {sum(cap.graph_breaks.values())} break(s), {len(cap.leaves)} leaves"
    elif cap is not None and cap.error:  # the cause, where the reason nests "... failed: ..."
        short += f" ({cap.error.rsplit('failed: ', 1)[-1][:80]})"
    mean = lambda d: sum(d[s] for s in c.steps) / len(c.steps)  # noqa: E731
    return {"model": name, "cycle": c.index, "steps": c.steps, "capture": short, "nodes": len(c.nodes),
            "fwd": c.forward_ms_per_step, "bwd": c.backward_ms_per_step, "fwd_wall": c.forward_wall_ms,
            "bwd_wall": c.backward_wall_ms, "bwd_outside": c.backward_outside_ms, "my_fwd": mean(fwd),
            "my_bwd": mean(bwd), "unowned": c.unowned()}


def row(r: dict) -> tuple[str, str]:
    named_f = sum(f or 0.0 for f, _ in r["unowned"].values())
    named_b = sum(b or 0.0 for _, b in r["unowned"].values())
    named = "; ".join(f"{NAMED[k]} {f if f is not None else b:.3f}" for k, (f, b) in r["unowned"].items())
    num = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    first = (f"| {r['model']} | {r['capture']} | {r['fwd'] / r['my_fwd']:.2f} | {(r['fwd'] + named_f) / r['my_fwd']:.2f} "
             f"| {r['bwd'] / r['my_bwd']:.2f} | {(r['bwd'] + named_b) / r['my_bwd']:.2f} | {named or 'none'} |")
    second = (f"| {r['model']} | {r['steps'][0]}-{r['steps'][-1]} | {r['nodes']} | {r['my_fwd']:.2f} | {num(r['fwd_wall'])} "
              f"| {r['fwd']:.2f} | {r['my_bwd']:.2f} | {num(r['bwd_wall'])} | {r['bwd']:.2f} | {num(r['bwd_outside'])} |")
    return first, second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MODELS), help="run this model only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)))
        return 0
    began, stall = time.perf_counter(), cpu_stall_us()
    print("fxprof_lightning: node rows (+ named rows) over the forward and backward measured in the LightningModule")
    print(f"date      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine   {platform.platform()}, {os.cpu_count()} CPUs, torch threads 1 (per model), "
          f"load avg {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"versions  python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}")
    print(f"package   {package_state()}")
    print("cycle     the last training cycle (cycle 1, steps 9-11); cycle 0 holds the capture\n")
    firsts, seconds = [], []
    for name, package in MODELS.items():
        if args.only and name != args.only:
            continue
        if package and importlib.util.find_spec(package) is None:
            print(f"{name}: skipped ({package} is not installed)")
            continue
        done = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True)
        result = next((line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
        if result is None:
            print(f"{name}: failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-400:]}")
            continue
        first, second = row(json.loads(result))
        firsts.append(first)
        seconds.append(second)
        print(f"{name} done ({time.perf_counter() - began:.0f} s)", flush=True)
    print("\n| model | capture | node fwd / measured | (node + named) fwd / measured | node bwd / measured "
          "| (node + named) bwd / measured | named rows, ms/step |")
    print("|---|---|---:|---:|---:|---:|---|")
    print("\n".join(firsts))
    print("\nms per recorded step: measured in the LightningModule, the cycle's own walls, the node rows")
    print("\n| model | steps | nodes | measured fwd | forward_wall_ms | node fwd | measured bwd | backward_wall_ms "
          "| node bwd | backward_outside_ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(seconds))
    print("", *closing_lines(stall, began), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
