"""Hugging Face in and out: transformers causal LMs as mxgraph models, their pretrained
weights read per rank, and trained weights written back as a Hugging Face directory.

- `models.py`: `build_hf_model("hf:llama", overrides)`, `HFCausalLM`, `hf_config`, `TINY`;
- `pretrained.py`: `load(DIR)` (meta-built, no weights yet) and `load_weights(model, step)`;
- `export.py`: a checkpoint to `config.json` + `model.safetensors` (+ tokenizer files);
- `files.py`: the directory layout both sides share (weight and index names, tokenizer
  files, the install hint).

Part of the application layer (hf -> data -> train -> cli): it imports the compiler only
through its public surface (`mxgraph.errors`, `mxgraph.plan`, named runtime modules), and
no compiler module imports it (`tests/test_layering.py`).
"""
from mxgraph.hf.models import TINY, HFCausalLM, build_hf_model, hf_config
from mxgraph.hf.pretrained import load, load_weights

__all__ = ["TINY", "HFCausalLM", "build_hf_model", "hf_config", "load", "load_weights"]
