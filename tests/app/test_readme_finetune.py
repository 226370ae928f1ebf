"""The README's "Fine-tune a Hugging Face model" commands, run as they stand in a directory
holding `DIR` (a tiny Llama saved with `save_pretrained` beside a BPE tokenizer trained on
built-in text) and `corpus.jsonl` (built-in text as documents): the 2-rank tp2 run trains,
validates every 10 steps and checkpoints; the export loads with `from_pretrained` without a
missing or unexpected key, and its validation loss on the run's own validation batches
equals the run's last one within 1e-5 relative (fp32: the compiled tp2 step sums in another
order than transformers' eager forward)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mxgraph.hf.models import HFCausalLM
from tests.hf_checkpoint_dirs import built_in_text, save_model_dir

README = Path(__file__).resolve().parents[2] / "README.md"


def commands() -> str:
    section = README.read_text().split("### Fine-tune a Hugging Face model", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _flag(text: str, name: str) -> str:
    return re.search(rf"--{name} (\S+)", text).group(1)


@pytest.mark.slow(seconds=90)
def test_the_readme_fine_tune_commands_as_written(tmp_path):
    from transformers import AutoModelForCausalLM

    from mxgraph.data.batches import split
    from mxgraph.data.packed import PackedBatches
    from mxgraph.data.training_data import training_data

    save_model_dir(tmp_path / "DIR", "llama")
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for doc in built_in_text(300_000):
            f.write(json.dumps({"text": doc}) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    text = commands()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = [json.loads(line) for line in (tmp_path / "runs/ft/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "OUT", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    batch, seq, count = (int(_flag(text, name)) for name in ("batch-size", "seq-len", "val-batches"))
    data = training_data(str(tmp_path / "corpus.jsonl"), None, "text", str(tmp_path / "DIR"),
                         lambda: model.config.vocab_size, batch, seq, progress=False)
    batches = PackedBatches(split(data.tokens)[1], batch, seq, seed=12345)
    wrapped = HFCausalLM(model).eval()
    with torch.no_grad():
        hf_val = float(np.mean([wrapped(*batches.next()).item() for _ in range(count)]))
    assert abs(hf_val - evals[-1]["val_loss"]) <= 1e-5 * abs(hf_val), (hf_val, evals[-1])
