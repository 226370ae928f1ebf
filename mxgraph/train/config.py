"""`TrainConfig`: what `mxgraph train` runs. Each field is a CLI flag of the same name
(`mxgraph.cli.train._add_dataclass_flags`), its docstring the flag's help."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrainConfig:
    """What `mxgraph train` runs; each field is a CLI flag of the same name."""

    model: str = "llama-tiny"
    """Model preset (see `models.list_presets()`), or a Hugging Face transformers model with
    random weights: hf:<model_type> (e.g. hf:llama, hf:mixtral; the full-size defaults unless
    --model-config shrinks them) or the path of a config.json, or a pretrained one: a
    directory with config.json and model.safetensors (or model.safetensors.index.json), each
    rank reading only its part (needs pip install mxgraph[hf])."""
    model_config: str | None = None
    """Overrides of the model's config, key=value,...: fields of the preset's config (e.g.
    n_layers=2) or of the Hugging Face config (e.g. hidden_size=64,num_hidden_layers=2)."""
    plan: str | None = None
    """Plan TOML file; default = one device, no rewrites."""
    steps: int = 600
    """Optimizer steps applied (a step --on-nonfinite skips or rolls back is not counted)."""
    batch_size: int = 16
    """Sequences per step (per data-parallel rank)."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate (AdamW; linear warm-up then cosine decay to lr/10)."""
    warmup: int = 50
    """Warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    data: str | None = None
    """Training data, local: a .npy of token ids; documents to tokenize (needs a tokenizer): a
    .txt file (documents separated by blank lines), a .jsonl file (one JSON object per line,
    see --data-field), a .parquet file or a directory saved by datasets' save_to_disk
    (those two need pip install mxgraph[data]), tokenized once into DATA.<hash>.tokens.npy
    beside it (or beforehand by mxgraph data prepare) and packed; without a tokenizer a text
    file's bytes are the tokens. Default = built-in stdlib text (bytes). The last 5 percent of the
    tokens are the validation split."""
    tokenizer: str | None = None
    """Directory of a saved Hugging Face tokenizer (tokenizer.json / tokenizer_config.json;
    pip install mxgraph[hf]) for --data documents; default = the --model directory's own
    tokenizer files, if any. Its end-of-text token ends every document."""
    data_field: str = "text"
    """The field (.jsonl) or column (.parquet, datasets directory) holding each document."""
    val_batches: int = 20
    """Batches averaged for the validation loss at the end."""
    seed: int = 0
    """Seed for initialisation and data order."""
    precision: str | None = None
    """fp32 (default), bf16-mixed (bf16 parameters in the compiled step; fp32 gradient
    accumulation, data-parallel reduction, clipping, AdamW and master weights, which
    checkpoints save) or bf16 (pure: parameters, gradients and AdamW state in bf16). Or
    set precision in the --plan file."""
    dtype: str | None = None
    """Older spelling: float32 = --precision fp32, bfloat16 = --precision bf16."""
    eager: bool = False
    """Run the model eagerly instead of compiling (for comparison)."""
    save_every: int = 0
    """Flash-checkpoint every N steps (0 = never); see --checkpoint-dir."""
    checkpoint_dir: str = "runs/checkpoints"
    """Where committed checkpoints go (torch.distributed.checkpoint format)."""
    resume: bool = False
    """Resume from the newest intact snapshot: in memory if every rank has it, else disk."""
    keep: int = 2
    """Committed checkpoints kept on disk (every one of a healthy state: a step with a
    non-finite loss, gradient or parameter is never saved)."""
    on_nonfinite: str = "stop"
    """What a step whose loss or gradient norm is NaN or Inf does: stop (end the run before
    its update, exit status 2, the last good checkpoint intact), skip (no update, the data
    moves on), or rollback (reload the newest snapshot from memory and skip the batches read
    since; needs --save-every). The log names the step, the ranks and the first non-finite
    parameter."""
    max_skips: int = 10
    """skip and rollback: the run stops after this many such steps in a row."""
    loss_spike: float = 0.0
    """A loss above this many times the median of the last --loss-spike-window applied
    steps' losses is handled as --on-nonfinite says (0 = off)."""
    loss_spike_window: int = 100
    """Steps whose median loss --loss-spike compares with."""
    profile: str | None = None
    """Directory for a torch.profiler Chrome trace per rank, DIR/rank{R}.json (CPU activity;
    CUDA too on a GPU). Steps 1-2 are warm-up (the first runs allocate, the second starts
    the profiler) and are not recorded; then --profile-steps steps are (with fewer than 3
    steps: every step). Read one with mxgraph inspect --overlap DIR/rank0.json."""
    profile_steps: int = 4
    """Steps --profile records after its 2 warm-up steps."""
    monitor_level: int = 0
    """Slow-node detection on every rank: 0 times each step's data, forward+backward,
    gradient synchronisation and optimizer (ms per step); 1 also every layer's forward and
    backward and every collective (its transfer and its wait apart) inside the compiled
    step; 2 also every op (torch.profiler, slow). Each report interval the ranks compare
    their sections with the median of ranks; findings go to the log and --monitor-json."""
    monitor_every: int = 10
    """Steps per report interval; a section slow in 2 intervals in a row is reported."""
    monitor_json: str = "runs/slow_nodes.jsonl"
    """Where rank 0 appends each finding as a JSON line (step, rank, host, section, kind,
    value_ms, reference_ms, slowdown against the median of ranks)."""
    eval_every: int = 0
    """Validation every N applied steps too (0 = only at the end): the mean loss over
    --val-batches fixed batches, logged and written to --log-dir as val_loss. Training is
    unchanged by it (own batches, no gradients, the random state put back)."""
    log_dir: str | None = None
    """Directory for metrics, written by rank 0: metrics.jsonl (one JSON object per logged
    step: step, loss, lr, grad_norm, tokens_per_s, mfu, memory_peak_bytes and memory_kind,
    dropped_fraction for MoE models, val_loss on --eval-every steps), run.json (model FLOPs
    per token, the peak FLOP/s MFU divides by) and TensorBoard scalars of the same names
    (see --report-to; mxgraph/train/metrics.py)."""
    log_every: int = 10
    """Steps between --log-dir records (an --eval-every step gets one too)."""
    report_to: str = "jsonl,tensorboard"
    """What --log-dir holds, comma-separated (as Hugging Face Trainer's report_to): jsonl
    (metrics.jsonl), tensorboard (event files; needs pip install mxgraph[metrics])."""
    device_profile: str | None = None
    """Device profile whose peak_flops MFU divides by: a built-in name (a100-80gb, h100-sxm,
    h100-hbm2e-500w, h800, metax-c500, cpu) or a TOML device file (as mxgraph search --device); default: the
    profile of this device's name (cpu on the CPU). MFU = model FLOPs per token (6 x the
    parameters of a token's matmuls, active experts only, + 12 x layers x width x seq_len)
    x tokens/s of all data-parallel ranks / (peak_flops x processes)."""
