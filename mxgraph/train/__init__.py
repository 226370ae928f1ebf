"""The `mxgraph train` application: the loop, its config, precision, checkpoints (with the
manifest of a run's model), metrics and FLOPs, and the one `--model` resolver that train,
export, inspect and search use.

- `config.py`: `TrainConfig`, every flag of `mxgraph train`;
- `loop.py`: `train(config)`, the training loop;
- `model_spec.py`: `--model` (a preset, a TOML model file, `hf:<type>`, a model directory);
- `precision.py`, `checkpoints.py`, `metrics.py`, `flops.py`, `overlap_report.py`.

Part of the application layer (hf -> data -> train -> cli): it may import `mxgraph.hf`,
`mxgraph.data`, `models` and the compiler's public surface (`mxgraph.compile`, `Plan`, the
step, errors, named runtime modules), never passes, codegen, the driver or the IR; nothing
in the compiler imports it.
"""
from mxgraph.train.config import TrainConfig
from mxgraph.train.loop import train

__all__ = ["TrainConfig", "train"]
