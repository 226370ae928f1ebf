"""Benchmark mxgraph's fused kernels against eager torch and torch.compile on a GPU.

For every fused op (forward, and forward+backward) at LLM shapes (tokens 8k-32k, hidden
4k-8k, bf16 by default) it times three implementations of the same computation:

  eager    the plain torch code a model would contain (e.g. ``F.silu(a) * b``)
  compile  ``torch.compile`` of that code
  fused    the ``torch.ops.mxgraph`` custom op (Triton on ``cuda``)

and reports milliseconds, achieved GB/s (bytes an ideal kernel must move / time) as a
fraction of the measured device-copy bandwidth, TFLOP/s for attention, peak extra memory,
and the speed-up over eager. It prints a table and writes JSON (``--out``).

Without a GPU it says so and exits 0. ``--smoke`` runs tiny shapes on the CPU instead (fused
ops take their reference path there; torch.compile is skipped) to check the script itself.

Suites are listed in ``SUITES``: ``kernels`` is this file's; an end-to-end suite (e.g. a
~1B Llama with fusion on and off) can be added there as another ``name -> function(args)``
entry returning result rows.

    python benchmarks/bench_kernels.py --out bench.json
    python benchmarks/bench_kernels.py --kernels swiglu,rmsnorm --tokens 8192 --hidden 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import mxgraph.codegen.kernels  # noqa: F401  (registers torch.ops.mxgraph.*)

ops = torch.ops.mxgraph
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(kw_only=True)
class Case:
    kernel: str
    shape: str
    make_inputs: Callable[[], tuple]
    """Returns the argument tuple; floating tensors with requires_grad get gradients."""
    eager: Callable
    fused: Callable
    fwd_bytes: int
    bwd_bytes: int
    fwd_flops: int = 0
    bwd_flops: int = 0
    backward: bool = True
    checked: bool = True
    """Whether the fused op's outputs and gradients are compared with eager's (`err`); not
    for a random mask drawn by each its own way (dropout)."""


# --------------------------------------------------------------------------- eager code
def _rotate_half(x, cos, sin):
    r = cos.shape[-1]
    xr = x[..., :r]
    rot = torch.cat([-xr[..., r // 2:], xr[..., : r // 2]], dim=-1)
    return torch.cat([xr * cos[None, :, None] + rot * sin[None, :, None], x[..., r:]], dim=-1)


def _eager_moe(x, ids, probs, num_experts):
    t, k = ids.shape
    order = ids.flatten().argsort(stable=True)
    rows = x[order // k]                          # permute (the experts would run here)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    weighted = rows * probs.flatten()[order, None].to(rows.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, weighted), counts


def _eager_router(logits, bias, topk, groups, topk_groups):
    t, e = logits.shape
    scores = torch.sigmoid(logits.float())
    sel = (scores + bias).detach()
    gscore = sel.view(t, groups, -1).topk(topk // topk_groups, -1).values.sum(-1)
    keep = torch.zeros(t, groups, dtype=torch.bool, device=logits.device).scatter_(
        1, gscore.topk(topk_groups, -1).indices, True)
    sel = sel.masked_fill(~keep.repeat_interleave(e // groups, 1), float("-inf"))
    ids = sel.topk(topk, -1).indices
    probs = scores.gather(1, ids)
    return probs / (probs.sum(-1, keepdim=True) + 1e-20) * 2.5, ids


# --------------------------------------------------------------------------- cases
def make_cases(tokens: int, hidden: int, dtype: torch.dtype, device: str, seq: int, vocab: int) -> list[Case]:
    t, h, es = tokens, hidden, torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape, grad=True, dt=dtype, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dt).requires_grad_(grad)

    n = t * h
    cases = [
        Case(kernel="swiglu", shape=f"[{t},{h}]", make_inputs=lambda: (rnd(t, h), rnd(t, h)),
             eager=lambda a, b: F.silu(a) * b, fused=ops.swiglu, fwd_bytes=3 * n * es, bwd_bytes=5 * n * es),
        Case(kernel="bias_swiglu", shape=f"[{t},{h}]", make_inputs=lambda: (rnd(t, h), rnd(t, h), rnd(h), rnd(h)),
             eager=lambda a, b, ba, bb: F.silu(a + ba) * (b + bb), fused=ops.bias_swiglu,
             fwd_bytes=3 * n * es, bwd_bytes=5 * n * es),
    ]
    for approx in ("none", "tanh"):
        cases.append(Case(kernel=f"bias_gelu[{approx}]", shape=f"[{t},{h}]", make_inputs=lambda: (rnd(t, h), rnd(h)),
                          eager=lambda x, b, a=approx: F.gelu(x + b, approximate=a),
                          fused=lambda x, b, a=approx: ops.bias_gelu(x, b, a), fwd_bytes=2 * n * es,
                          bwd_bytes=3 * n * es))
    cases += [
        Case(kernel="bias_dropout_add", shape=f"[{t},{h}] p=0.1",
             make_inputs=lambda: (rnd(t, h), rnd(h), rnd(t, h)),
             eager=lambda x, b, r: r + F.dropout(x + b, p=0.1, training=True),
             fused=lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.1, True, 1234, 0), checked=False,
             fwd_bytes=3 * n * es, bwd_bytes=2 * n * es),
        Case(kernel="rmsnorm", shape=f"[{t},{h}]", make_inputs=lambda: (rnd(t, h), rnd(h)),
             eager=lambda x, w: F.rms_norm(x, (h,), w, 1e-6), fused=lambda x, w: ops.rmsnorm(x, w, 1e-6)[0],
             fwd_bytes=2 * n * es, bwd_bytes=3 * n * es),
        Case(kernel="add_rmsnorm", shape=f"[{t},{h}]", make_inputs=lambda: (rnd(t, h), rnd(t, h), rnd(h)),
             eager=lambda x, r, w: (F.rms_norm(x + r, (h,), w, 1e-6), x + r),
             fused=lambda x, r, w: ops.add_rmsnorm(x, r, w, 1e-6)[:2], fwd_bytes=4 * n * es, bwd_bytes=4 * n * es),
    ]
    d = 128
    hq = max(1, h // d)
    hkv = max(1, hq // 4)
    b = max(1, t // seq)
    s = t // b
    qn, kn = b * s * hq * d, b * s * hkv * d

    def rope_inputs():
        ang = torch.arange(s, device=device)[:, None] * 10000 ** (-torch.arange(0, d, 2, device=device) / d)
        ang = torch.cat([ang, ang], -1)
        return rnd(b, s, hq, d), rnd(b, s, hkv, d), ang.cos().to(dtype), ang.sin().to(dtype)

    cases.append(Case(kernel="rope", shape=f"q[{b},{s},{hq},{d}] k[{b},{s},{hkv},{d}]", make_inputs=rope_inputs,
                      eager=lambda q, k, c, sn: (_rotate_half(q, c, sn), _rotate_half(k, c, sn)),
                      fused=lambda q, k, c, sn: ops.rope(q, k, c, sn, False),
                      fwd_bytes=2 * (qn + kn) * es, bwd_bytes=2 * (qn + kn) * es))
    attn_flops = 4 * b * hq * s * s * d // 2  # causal
    scale = 1 / math.sqrt(d)
    cases.append(Case(kernel="gqa_attention", shape=f"q[{b},{hq},{s},{d}] kv[{b},{hkv},{s},{d}] causal",
                      make_inputs=lambda: (rnd(b, hq, s, d), rnd(b, hkv, s, d), rnd(b, hkv, s, d)),
                      eager=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                           enable_gqa=True),
                      fused=lambda q, k, v: ops.gqa_attention(q, k, v, True, scale)[0],
                      fwd_bytes=(2 * qn + 2 * kn) * es, bwd_bytes=(4 * qn + 4 * kn) * es,
                      fwd_flops=attn_flops, bwd_flops=int(2.5 * attn_flops)))
    v = vocab
    chunk = 4096

    def lce_inputs():
        return rnd(t, h), rnd(v, h, scale=h ** -0.5), torch.randint(0, v, (t,), device=device)

    cases.append(Case(kernel="linear_cross_entropy", shape=f"x[{t},{h}] W[{v},{h}] chunk={chunk}",
                      make_inputs=lce_inputs, eager=lambda x, w, tg: F.cross_entropy((x @ w.T).float(), tg),
                      fused=lambda x, w, tg: ops.linear_cross_entropy(x, w, tg, chunk, -100)[0],
                      fwd_bytes=(t * h + v * h) * es, bwd_bytes=2 * (t * h + v * h) * es,
                      fwd_flops=2 * t * h * v, bwd_flops=6 * t * h * v))
    e, k = 64, 8

    def moe_inputs():
        ids = torch.rand(t, e, device=device).topk(k, -1).indices
        return rnd(t, h), ids, torch.rand(t, k, device=device).requires_grad_()

    def fused_moe(x, ids, probs):
        rows, row_map, counts = ops.moe_permute(x, ids, e)
        return ops.moe_unpermute(rows, row_map, probs), counts

    cases.append(Case(kernel="moe_permute+unpermute", shape=f"x[{t},{h}] E={e} K={k}", make_inputs=moe_inputs,
                      eager=lambda x, ids, p: _eager_moe(x, ids, p, e), fused=fused_moe,
                      fwd_bytes=(2 * t + 2 * t * k) * h * es, bwd_bytes=(2 * t + 3 * t * k) * h * es))
    er, kr, groups, tg = 256, 8, 8, 4

    def router_inputs():
        return rnd(t, er), torch.randn(er, device=device) * 0.01

    cases.append(Case(kernel="moe_router", shape=f"logits[{t},{er}] sigmoid K={kr} groups={groups}/{tg}",
                      make_inputs=router_inputs, eager=lambda lg, bias: _eager_router(lg, bias, kr, groups, tg),
                      fused=lambda lg, bias: ops.moe_router(lg, bias, kr, "sigmoid", groups, tg, True, 2.5)[:2],
                      fwd_bytes=t * er * es + t * kr * 12, bwd_bytes=2 * t * er * es + t * kr * 12))
    return cases


# --------------------------------------------------------------------------- timing
def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def copy_bandwidth_gbps(device: str, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * nbytes / ms / 1e6


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _fwd_bwd(fn, args):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = [o for o in _as_tuple(fn(*args)) if o.is_floating_point() and o.requires_grad]
    grads = [torch.ones_like(o) for o in outs]

    def step():
        res = [o for o in _as_tuple(fn(*args)) if o.is_floating_point() and o.requires_grad]
        torch.autograd.grad(res, leaves, grads)

    return step


def _peak_mib(fn, device) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2}
"""Largest `err` (per output and gradient: max |fused - eager| / max |eager|) that passes."""


def _values(fn, inputs, backward: bool) -> list[torch.Tensor]:
    """`fn`'s floating outputs and, with `backward`, the gradients of the inputs that need
    one for a random output gradient (seeded: the same for every implementation), in fp32.
    Not all-ones: the router's probabilities are normalised to a constant sum, so an
    all-ones gradient gives its logits a zero gradient, all rounding noise (an H200 run
    flagged it WRONG for the fused kernel and torch.compile alike)."""
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = [o for o in _as_tuple(fn(*inputs)) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    values = [o.detach().float() for o in outs]
    differentiable = [o for o in outs if o.requires_grad]
    if backward and differentiable:
        seed = torch.Generator(differentiable[0].device).manual_seed(0)
        upstream = [torch.randn(o.shape, generator=seed, device=o.device).to(o.dtype) for o in differentiable]
        grads = torch.autograd.grad(differentiable, leaves, upstream, allow_unused=True)
        values += [g.float() for g in grads if g is not None]
    return values


def error(fn, reference, inputs, backward: bool) -> float:
    """Largest relative error of `fn`'s outputs (and gradients) against `reference`'s."""
    actual, expected = _values(fn, inputs, backward), _values(reference, inputs, backward)
    if len(actual) != len(expected):
        return float("inf")
    return max(((a - e).abs().max() / e.abs().max().clamp_min(1e-12)).item()
               for a, e in zip(actual, expected, strict=True))


def run_case(case: Case, args, device: str, copy_gbps: float) -> list[dict]:
    inputs = case.make_inputs()
    impls = {"eager": case.eager, "fused": case.fused}
    if not args.no_compile and device == "cuda":
        torch._dynamo.reset()  # each case compiles afresh: shapes and closures never hit a recompile limit
        impls["compile"] = torch.compile(case.eager, dynamic=False)
    rows = []
    for phase in ("fwd", "fwd+bwd") if case.backward else ("fwd",):
        nbytes = case.fwd_bytes + (case.bwd_bytes if phase == "fwd+bwd" else 0)
        flops = case.fwd_flops + (case.bwd_flops if phase == "fwd+bwd" else 0)
        for name, fn in impls.items():
            row = dict(kernel=case.kernel, shape=case.shape, phase=phase, impl=name)
            try:
                if phase == "fwd":
                    def step(fn=fn, inputs=inputs):
                        with torch.no_grad():
                            fn(*inputs)
                else:
                    step = _fwd_bwd(fn, inputs)
                if case.checked and name != "eager":
                    row["err"] = error(fn, case.eager, inputs, phase != "fwd")
                    row["ok"] = row["err"] <= TOLERANCE[args.dtype]
                ms = time_ms(step, device, args.warmup, args.iters)
                row.update(ms=ms, gbps=nbytes / ms / 1e6, copy_frac=nbytes / ms / 1e6 / copy_gbps,
                           tflops=flops / ms / 1e9 if flops else None, peak_mib=_peak_mib(step, device))
            except Exception as exc:  # one failing implementation must not hide the others
                row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append(row)
    eager = {r["phase"]: r.get("ms") for r in rows if r["impl"] == "eager"}
    for r in rows:
        if r.get("ms") and eager.get(r["phase"]):
            r["speedup_vs_eager"] = eager[r["phase"]] / r["ms"]
    del inputs
    return rows


def bench_kernel_cases(args, device: str, copy_gbps: float) -> list[dict]:
    dtype = DTYPES[args.dtype]
    wanted = set(args.kernels.split(",")) if args.kernels else None
    rows = []
    for tokens in args.tokens:
        for hidden in args.hidden:
            for case in make_cases(tokens, hidden, dtype, device, args.seq, args.vocab):
                if wanted and case.kernel.split("[")[0] not in wanted:
                    continue
                rows += run_case(case, args, device, copy_gbps)
                print_rows(rows[-(3 if device == "cuda" and not args.no_compile else 2) * 2:], header=False)
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


SUITES: dict[str, Callable] = {"kernels": bench_kernel_cases}


# --------------------------------------------------------------------------- output
_COLS = [("kernel", 22), ("shape", 44), ("phase", 8), ("impl", 8), ("ms", 9), ("gbps", 8), ("copy_frac", 9),
         ("tflops", 7), ("peak_mib", 9), ("speedup_vs_eager", 8), ("err", 9)]


def _fmt(v, width):
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:{width}.3f}" if abs(v) < 1e4 else f"{v:{width}.3g}"
    return str(v)[:width].ljust(width)


def print_rows(rows, header=True):
    if header:
        print(" ".join(name[:w].ljust(w) for name, w in _COLS))
    for r in rows:
        line = " ".join(_fmt(r.get(name), w) for name, w in _COLS)
        print(line + (f"  ERROR {r['error']}" if "error" in r else "")
              + (f"  WRONG (err above {TOLERANCE})" if r.get("ok") is False else ""), flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--suite", default="kernels", choices=sorted(SUITES), help="which suite to run")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all), e.g. swiglu,rope")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="token counts (batch * seq)")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192], help="hidden sizes")
    p.add_argument("--seq", type=int, default=4096, help="sequence length for rope/attention (batch = tokens / seq)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size for linear_cross_entropy")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU (reference paths, no compile): checks the script, not speed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device = "cpu"
        args.tokens, args.hidden, args.seq, args.vocab = [64], [256], 32, 300
        args.warmup, args.iters, args.no_compile = 1, 1, True
        args.dtype = "fp32"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("bench_kernels: no GPU available (torch.cuda.is_available() is False); nothing to benchmark.")
        return 0
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    copy_gbps = copy_bandwidth_gbps(device, 1 << 30 if device == "cuda" else 1 << 24)
    print(f"device: {name}; measured device-copy bandwidth {copy_gbps:.1f} GB/s; dtype {args.dtype}")
    print_rows([], header=True)
    rows = SUITES[args.suite](args, device, copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, dtype=args.dtype, copy_bandwidth_gbps=copy_gbps, torch=torch.__version__,
                           suite=args.suite, results=rows), f, indent=1)
        print(f"wrote {args.out}")
    wrong = [f"{r['kernel']} {r['shape']} {r['phase']} {r['impl']}" for r in rows if r.get("ok") is False]
    if wrong:
        print(f"{len(wrong)} implementation(s) differ from eager beyond the tolerance: {'; '.join(wrong)}")
    return 1 if wrong else 0



# --------------------------------------------------------------------------- end to end: fusion on vs off
def bench_llama_fusion(args, device: str, copy_gbps: float) -> list[dict]:
    """A ~1B Llama (preset ``llama-1b``, TinyLlama's shape) trained by ``mxgraph.compile`` with
    ``Plan(fusion=True)`` vs ``Plan(fusion=False)``: ms per step (forward + backward, grads into
    ``.grad``), tokens/s, peak memory, and the first-step loss gap (``--suite llama1b_fusion``;
    batch = first ``--tokens`` / ``--seq``). ``--smoke`` runs ``llama-tiny`` on the CPU."""
    import models
    import mxgraph as mx

    name, seq = ("llama-tiny", 32) if device == "cpu" else ("llama-1b", min(args.seq, 2048))
    batch = max(1, args.tokens[0] // seq)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    model = models.build_model(name, device=device, dtype=dtype)
    vocab = model.config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), device=device, generator=g)
    targets = torch.randint(0, vocab, (batch, seq), device=device, generator=g)
    rows, losses = [], {}
    for impl, fusion in (("unfused", False), ("fused", True)):
        start = time.perf_counter()
        step = mx.compile(model, mx.Plan(fusion=fusion))
        losses[impl] = step(tokens, targets).float().item()
        compile_s = time.perf_counter() - start

        def run(step=step):
            model.zero_grad(set_to_none=True)
            return step(tokens, targets)
        ms = time_ms(run, device, args.warmup, args.iters)
        rows.append(dict(kernel=f"{name} e2e", shape=f"B={batch} S={seq} {args.dtype}", phase="fwd+bwd",
                         impl=impl, ms=ms, tokens_per_s=batch * seq / ms * 1e3, compile_s=compile_s,
                         peak_mib=_peak_mib(run, device), loss=losses[impl]))
        model.zero_grad(set_to_none=True)
        del step
        if device == "cuda":
            torch.cuda.empty_cache()
    rows[1]["speedup_vs_eager"] = rows[0]["ms"] / rows[1]["ms"]  # here: fused vs unfused
    rows[1]["loss_gap"] = abs(losses["fused"] - losses["unfused"]) / abs(losses["unfused"])
    print_rows(rows, header=False)
    print(f"tokens/s unfused {rows[0]['tokens_per_s']:.0f}, fused {rows[1]['tokens_per_s']:.0f}; "
          f"first-step loss gap {rows[1]['loss_gap']:.2e}")
    return rows


SUITES["llama1b_fusion"] = bench_llama_fusion


if __name__ == "__main__":
    sys.exit(main())
