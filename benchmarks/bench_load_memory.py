"""Peak resident memory of each rank while it loads a pretrained Hugging Face model under
tensor parallelism (`mxgraph/hf/pretrained.py`), against the whole model's size.

A Llama of about 1 GB in fp32 (hidden 2048, MLP 5632, vocabulary 32000, 3 layers) is made
with random weights and saved with `save_pretrained` in a temporary directory; then
`--nproc` processes (torchrun, gloo) each build it with `mxgraph.hf.load` (meta device,
zero-stride stand-ins), compile it under `--plan` (tp=2) for a batch of 1 x 16 tokens
(tracing only: `step.prepare`), and read their slices with `load_weights`. Each rank reports
its resident memory (VmRSS) after the imports, after compile, and its peak (VmHWM) during
compile and during the load alone (the peak is reset before the load by writing 5 to
/proc/self/clear_refs); `load_peak_over_model` = (load peak - resident after compile) /
model bytes, the target being under 0.6 (a rank holds half the model under tp=2, plus one
tensor being read).

    python benchmarks/bench_load_memory.py [--hidden 2048] [--layers 3] [--nproc 2]
        [--plan tp=2] [--out bench_results/load_memory.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

MIB = 1 << 20


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: 5 > /proc/self/clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def save_model(directory: str, hidden: int, layers: int, vocab: int, intermediate: int) -> int:
    """A random Llama saved with save_pretrained into `directory`; returns its bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab,
                         intermediate_size=intermediate, num_attention_heads=hidden // 128,
                         num_key_value_heads=hidden // 128, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def worker(directory: str, plan_text: str, out: str) -> None:
    """One rank: build, compile, load; write its memory figures to `out`.rank<R>.json."""
    import torch.distributed as dist

    import mxgraph
    import mxgraph.hf
    from mxgraph.hf.pretrained import load_weights
    from mxgraph.plan import Plan
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    after_imports = status_kib("VmRSS")
    model = mxgraph.hf.load(directory)
    fields = dict(item.split("=") for item in plan_text.split(",") if item)
    step = mxgraph.compile(model, Plan(**{k: int(v) for k, v in fields.items()}))
    tokens = torch.zeros(1, 16, dtype=torch.long)
    step.prepare(tokens, tokens)
    after_compile, compile_peak = status_kib("VmRSS"), status_kib("VmHWM")
    reset = reset_peak()
    load_weights(model, step)
    load_peak = status_kib("VmHWM")
    held = sum(p.numel() * p.element_size() for _, p in step.model_parameters())
    figures = {"rank": rank, "rss_after_imports_mib": after_imports * 1024 / MIB,
               "rss_after_compile_mib": after_compile * 1024 / MIB,
               "peak_during_compile_mib": compile_peak * 1024 / MIB,
               "peak_during_load_mib": load_peak * 1024 / MIB, "peak_reset": reset,
               "held_parameters_mib": held / MIB}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--plan", default="tp=2", help="Plan fields, key=value,...")
    parser.add_argument("--out", default="bench_results/load_memory.json")
    parser.add_argument("--worker", nargs=3, metavar=("DIR", "PLAN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return {}
    with tempfile.TemporaryDirectory(prefix="mxgraph-load-") as tmp:
        model_bytes = save_model(tmp, args.hidden, args.layers, args.vocab, args.intermediate)
        prefix = os.path.join(tmp, "figures")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.nproc}", os.path.abspath(__file__),
                   "--worker", tmp, args.plan, prefix]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        ranks = [json.loads(Path(f"{prefix}.rank{r}.json").read_text())
                 for r in range(args.nproc)]
    model_mib = model_bytes / MIB
    print(f"Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}: "
          f"{model_mib:,.0f} MiB fp32; plan {args.plan} on {args.nproc} processes")
    print(f"{'rank':>4} {'imports':>8} {'compiled':>9} {'load peak':>10} {'load delta':>11} "
          f"{'held':>7} {'delta/model':>12} {'peak/model':>11}   (MiB)")
    for row in ranks:
        delta = row["peak_during_load_mib"] - row["rss_after_compile_mib"]
        row["load_delta_mib"] = delta
        row["load_peak_over_model"] = delta / model_mib
        whole = max(row["peak_during_compile_mib"], row["peak_during_load_mib"])
        row["peak_over_model"] = (whole - row["rss_after_imports_mib"]) / model_mib
        print(f"{row['rank']:>4} {row['rss_after_imports_mib']:>8.0f} "
              f"{row['rss_after_compile_mib']:>9.0f} {row['peak_during_load_mib']:>10.0f} "
              f"{delta:>11.0f} {row['held_parameters_mib']:>7.0f} "
              f"{row['load_peak_over_model']:>12.2f} {row['peak_over_model']:>11.2f}")
    result = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
              "intermediate": args.intermediate, "plan": args.plan, "nproc": args.nproc,
              "model_mib": model_mib, "ranks": ranks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
