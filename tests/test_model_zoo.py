"""benchmarks/model_zoo.py --quick runs end to end, and its HuggingFace rows are what the README claims.

Every quick HF model (trained by a real Trainer with and without the callback) must be timed node by node
(``dynamo``, no leaf, no module hooks) and end with weights bitwise equal to the run without the callback.
"""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "model_zoo.py"
QUICK_HF = ["LlamaForCausalLM", "BertForSequenceClassification", "T5ForConditionalGeneration",
            "ViTForImageClassification", "LoRA(LlamaForCausalLM)"]


def test_model_zoo_quick_run_traces_every_hf_model_and_keeps_training_bitwise_equal():
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    hf_part = run.stdout.split("HuggingFace models trained")[1]
    assert "module_hooks" not in hf_part, hf_part
    for model in QUICK_HF:
        (row,) = [line for line in hf_part.splitlines() if line.startswith(model + " ")]
        cells = row.split()
        assert cells[2] == "dynamo", row  # cells: model, attention, capture, nodes, bwd>0, graphs, leaves
        assert int(cells[3]) > 50 and cells[6] == "0", row  # rows: a torch.nn layer is one row, other ops one each
        assert cells[8] == "yes", row  # every weight bitwise equal
    assert "weights bitwise equal with and without the callback: 5/5" in hf_part
    assert "crashed with the callback: 0" in hf_part
