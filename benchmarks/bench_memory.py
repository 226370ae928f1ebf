"""Memory benchmark: saved activations and step time per recompute/offload policy.

Part 1 (CPU, measured): for llama-20m and moe-20m (`--models`: any llama or MoE preset,
with its family's POLICIES), each mxgraph policy's saved-activation bytes (measured at the
forward/backward boundary of the compiled step, see mxgraph/memory_saved.py) and its
estimate from the graph, next to eager PyTorch without and with `torch.utils.checkpoint`
over whole layers (the peer; its saved bytes are counted with
`torch.autograd.graph.saved_tensors_hooks`, reentrant checkpoint so the layer inputs pass
through the hooks too), with the median step time of each.

Part 2 (estimator, nothing allocated): per-rank memory of llama2-70b and deepseek-v3-671b
under a few plans (mxgraph/memory_plan.py), and per-layer activation bytes beside
Megatron-LM's formula s*b*h*(34 + 5*a*s/h) bytes per layer (half precision; / t with
TP + SP; "flash" drops the 5as/h attention-matrix term, which flash attention never
stores).

    python benchmarks/bench_memory.py [--seq 128] [--batch 2] [--steps 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import models  # noqa: E402
import mxgraph as mx  # noqa: E402
from mxgraph.memory_plan import estimate_memory, trace_layer_activations  # noqa: E402
from mxgraph.memory_saved import estimate_saved, measure_step  # noqa: E402

MiB = 2 ** 20
GiB = 2 ** 30
POLICIES = {  # model family -> Plan fields of each policy
    "llama": [dict(), dict(recompute="norm,act"), dict(recompute="norm,act,attn"),
              dict(recompute="mlp"), dict(recompute="full"), dict(offload="all"),
              dict(recompute="norm,act", offload="attn")],
    "moe": [dict(), dict(recompute="moe_light"), dict(recompute="moe_medium"),
            dict(recompute="moe_full"), dict(recompute="full"), dict(offload="moe")],
}


def batch(vocab: int, batch_size: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch_size, seq), generator=g),
            torch.randint(0, vocab, (batch_size, seq), generator=g))


def eager_saved_bytes(model, args) -> tuple[int, float]:
    """(saved bytes, seconds) of one eager forward+backward."""
    skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(
        model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*args)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), time.perf_counter() - start


def checkpoint_layers(model) -> None:
    """Wrap every layer's forward in reentrant torch.utils.checkpoint (Megatron 'full')."""
    for layer in model.layers:
        inner = layer.forward
        layer.forward = lambda *a, _f=inner: checkpoint(_f, *a, use_reentrant=True)


def bench_eager(name, args, steps, checkpointed):
    torch.manual_seed(0)
    model = models.build_model(name)
    if checkpointed:
        checkpoint_layers(model)
    results = [eager_saved_bytes(model, args) for _ in range(steps)]
    return {"runner": "eager+checkpoint(layers)" if checkpointed else "eager",
            "saved": results[-1][0], "estimate": None,
            "step_s": statistics.median(r[1] for r in results)}


def bench_mxgraph(name, args, steps, plan_kwargs):
    torch.manual_seed(0)
    model = models.build_model(name)
    step = mx.compile(model, mx.Plan(**plan_kwargs))
    start = time.perf_counter()
    step(*args)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - start)
    gm = step.executors()[0].stages[0].joint.gm
    measured = measure_step(step, *args)
    label = ", ".join(f"{k}={v}" for k, v in plan_kwargs.items()) or "none"
    return {"runner": f"mxgraph {label}", "saved": measured.device_bytes,
            "host": measured.host_bytes, "estimate": estimate_saved(gm).device_bytes,
            "step_s": statistics.median(times), "compile_s": compile_s}


def megatron_layer_bytes(cfg, seq: int, mbs: int, tp: int, flash: bool) -> float:
    h, a = cfg.dim, cfg.n_heads
    per = seq * mbs * h * (34 + (0 if flash else 5 * a * seq / h))
    return per / tp


def estimator_rows(seq: int) -> list[dict]:
    plans = {
        "llama2-70b": [
            ("tp8 pp4 sp, no recompute", dict(tp=8, pp=4, sequence_parallel=True,
                                              micro_batches=8)),
            ("tp8 pp4 sp, norm,act", dict(tp=8, pp=4, sequence_parallel=True, micro_batches=8,
                                          recompute="norm,act")),
            ("tp8 pp4 sp, full", dict(tp=8, pp=4, sequence_parallel=True, micro_batches=8,
                                      recompute="full")),
            ("tp8 pp4 sp, offload attn,mlp", dict(tp=8, pp=4, sequence_parallel=True,
                                                  micro_batches=8, offload="attn,mlp")),
        ],
        "deepseek-v3-671b": [
            ("pp16 ep64 zero1 dp64, none", dict(pp=16, ep=64, dp=64, zero1=True,
                                                micro_batches=32)),
            ("pp16 ep64 zero1 dp64, moe_light", dict(pp=16, ep=64, dp=64, zero1=True,
                                                     micro_batches=32, recompute="moe_light")),
            ("pp16 ep64 zero1 dp64, moe_full", dict(pp=16, ep=64, dp=64, zero1=True,
                                                    micro_batches=32, recompute="moe_full")),
        ],
    }
    rows = []
    for name, entries in plans.items():
        cfg = models.PRESETS[name][1]
        for label, kwargs in entries:
            plan = mx.Plan(**kwargs)
            start = time.perf_counter()
            stages = estimate_memory(name, plan, batch_size=1, seq_len=seq)
            acts = trace_layer_activations(cfg, plan, 1, seq)
            layer = acts.moe if acts.moe else acts.dense
            tp = plan.tp
            ours = layer / tp if plan.sequence_parallel else layer * (
                acts.replicated_fraction + (1 - acts.replicated_fraction) / tp)
            worst = max(stages, key=lambda s: s.device_total)
            rows.append({
                "model": name, "plan": label, "seconds": round(time.perf_counter() - start, 1),
                "max_rank_device_GiB": worst.device_total / GiB,
                "stage0_params_GiB": stages[0].params / GiB,
                "stage0_optimizer_GiB": stages[0].optimizer / GiB,
                "stage0_activations_GiB": stages[0].activations / GiB,
                "stage0_host_GiB": stages[0].offloaded / GiB,
                "layer_act_MiB": ours / MiB,
                "megatron_layer_MiB": megatron_layer_bytes(cfg, seq, 1, tp, flash=False) / MiB,
                "megatron_flash_layer_MiB": megatron_layer_bytes(cfg, seq, 1, tp, flash=True)
                / MiB,
            })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2, help="CPU part: batch size")
    parser.add_argument("--seq", type=int, default=128, help="CPU part: sequence length")
    parser.add_argument("--steps", type=int, default=3, help="CPU part: timed steps per runner")
    parser.add_argument("--est-seq", type=int, default=4096, help="estimator: sequence length")
    parser.add_argument("--models", default="llama-20m,moe-20m", help="CPU part: llama or MoE presets")
    parser.add_argument("--skip-cpu", action="store_true", help="only the estimator part")
    parser.add_argument("--skip-estimator", action="store_true", help="only the CPU part")
    parser.add_argument("--json", default="bench_results/bench_memory.json", help="output JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = {"cpu": {}, "estimator": []}
    if not args.skip_cpu:
        for name in args.models.split(","):
            cfg = models.PRESETS[name][1]
            inputs = batch(cfg.vocab_size, args.batch, args.seq)
            rows = [bench_eager(name, inputs, args.steps, False),
                    bench_eager(name, inputs, args.steps, True)]
            family = models.PRESETS[name][0]
            rows += [bench_mxgraph(name, inputs, args.steps, kw) for kw in POLICIES[family]]
            out["cpu"][name] = rows
            print(f"\n{name}  batch={args.batch} seq={args.seq} fp32, CPU "
                  f"{torch.get_num_threads()} thread(s)")
            print(f"{'runner':<44} {'saved MiB':>10} {'estimate':>9} {'host MiB':>9} "
                  f"{'step s':>7}")
            for r in rows:
                est = f"{r['estimate'] / MiB:9.2f}" if r["estimate"] is not None else f"{'-':>9}"
                print(f"{r['runner']:<44} {r['saved'] / MiB:>10.2f} {est} "
                      f"{r.get('host', 0) / MiB:>9.2f} {r['step_s']:>7.3f}")
    if not args.skip_estimator:
        out["estimator"] = estimator_rows(args.est_seq)
        print(f"\nestimator (bf16, micro-batch 1, seq {args.est_seq}); GiB per rank, "
              f"activation MiB per layer per micro-batch on one rank")
        print(f"{'model':<17} {'plan':<34} {'max rank':>9} {'acts s0':>8} {'host s0':>8} "
              f"{'layer':>8} {'Megatron':>9} {'M.flash':>8}")
        for r in out["estimator"]:
            print(f"{r['model']:<17} {r['plan']:<34} {r['max_rank_device_GiB']:>9.1f} "
                  f"{r['stage0_activations_GiB']:>8.1f} {r['stage0_host_GiB']:>8.1f} "
                  f"{r['layer_act_MiB']:>8.1f} {r['megatron_layer_MiB']:>9.1f} "
                  f"{r['megatron_flash_layer_MiB']:>8.1f}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
