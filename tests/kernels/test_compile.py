"""Every Triton kernel compiles for a GPU (sm_90 cubin) with the arguments its launch passes.

The interpreter tests check numerics but run kernels as Python: a kernel can pass them and
still fail to compile (types of loop-carried values, scalar masks, unsupported ops). Triton
compiles for a CUDA target without a GPU, so each launch the Triton paths make (recorded, not
run, with bf16 and fp16 inputs and the block sizes used on ``cuda``) is compiled here.

Triton cannot compile once ``TRITON_INTERPRET=1`` was set at import (the other kernel tests
set it), so the test runs this file as a script in a fresh interpreter without it.
"""

import os
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from mxgraph.codegen.kernels import (
    _common,
    bias_dropout_add,
    bias_gelu,
    gqa,
    linear_cross_entropy,
    moe_permute,
    moe_router,
    rmsnorm,
    rope,
    swiglu,
)

TARGET = GPUTarget("cuda", 90, 32)
LAUNCH_OPTIONS = ("num_warps", "num_stages")
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}


def _type(value):
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value)}")


def fn_no_spec(fn) -> set:
    """Parameter names the kernel's ``@triton.jit(do_not_specialize=...)`` exempts."""
    kernel = _KERNELS_BY_FN.get(fn)
    return {p.name for p in getattr(kernel, "params", []) if p.do_not_specialize}


_KERNELS_BY_FN: dict = {}


class _Recorder:
    """Stands in for ``_common.on``: records each launch without running it."""

    def __init__(self):
        self.launches = {}

    def on(self, kernel, device):
        def launcher(grid):
            def launch(*args, **kwargs):
                fn = getattr(kernel, "fn", kernel)
                _KERNELS_BY_FN[fn] = kernel
                names = JITFunction(fn).arg_names
                # as the JIT does, an int argument equal to 1 becomes a constexpr
                ones = {n for n, v in zip(names, args, strict=False)  # args may stop before the last names
                        if type(v) is int and v == 1 and n not in fn_no_spec(fn)}
                signature = {n: _type(v) for n, v in zip(names, args, strict=False) if n not in ones}
                constexprs = {n: v for n, v in kwargs.items() if n not in LAUNCH_OPTIONS}
                constexprs.update({n: 1 for n in ones})
                signature.update({n: "constexpr" for n in constexprs})
                options = {n: v for n, v in kwargs.items() if n in LAUNCH_OPTIONS}
                key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())))
                self.launches[key] = (fn, signature, constexprs, options)
            return launch

        return type("Launcher", (), {"__getitem__": lambda _self, grid: launcher(grid)})()


def _run_all_triton_paths(dtype):
    mk = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
    a, b, bias = mk(4, 96), mk(4, 96), mk(96)
    swiglu.swiglu_triton(a, b)
    swiglu.swiglu_backward_triton(a, a, b, bias, bias)
    for approx in ("none", "tanh"):
        bias_gelu.bias_gelu_triton(a, bias, approx)
        bias_gelu.bias_gelu_backward_triton(a, a, bias, approx)
    bias_dropout_add.bias_dropout_add_triton(a, bias, b, 0.1, True, 2**40 + 3, 2**33)
    bias_dropout_add.bias_dropout_add_triton(a, None, b, 0.0, False, 1, 0)
    bias_dropout_add.bias_dropout_add_triton(a, bias, b, 0.5, True, 0, 1)  # offset 1: no constexpr surprise
    bias_dropout_add.bias_dropout_add_backward_triton(a, 0.1, True, 7, 0)
    y, h, rstd = rmsnorm.add_rmsnorm_triton(a, b, bias, 1e-6)
    rmsnorm.rmsnorm_triton(a, bias, 1e-6)
    wide = mk(2, 8192)  # a Llama-70B-wide row: BLOCK_N 8192, 8 warps
    rmsnorm.rmsnorm_triton(wide, wide[0], 1e-6)
    rmsnorm.rmsnorm_backward_triton(wide, wide, wide[0], torch.ones(2), None)
    rmsnorm.rmsnorm_backward_triton(a, a, bias, torch.ones(4), a)
    rmsnorm.rmsnorm_backward_triton(a, a, bias, torch.ones(4), None)
    q, k, cos = mk(1, 8, 4, 128), mk(1, 8, 1, 128), torch.randn(8, 64)
    for inter in (False, True):
        rope.rope_triton(q, k, cos, cos, inter)
        rope.rope_backward_triton(q, k, cos, cos, inter)
    q, kv = mk(1, 4, 8, 128), mk(1, 2, 8, 128)
    gqa.gqa_attention_triton(q.float(), kv.float(), kv.float(), True, 0.1)  # fp32: ieee dots
    for causal in (False, True):
        gqa.gqa_attention_triton(q, kv, kv, causal, 0.1)
        gqa.gqa_attention_backward_triton(q, torch.zeros(1, 4, 8), q, kv, kv, q, torch.zeros(1, 4, 8), causal, 0.1)
    x, w, t = mk(6, 32), mk(50, 32), torch.randint(0, 50, (6,))
    linear_cross_entropy.linear_cross_entropy_triton(x, w, t, 4)
    linear_cross_entropy.linear_cross_entropy_backward_triton(torch.tensor(1.0), x, w, t, torch.zeros(6), 4)
    ids, probs = torch.tensor([[0, 1], [2, 0], [1, 3]]), torch.rand(3, 2)
    rows, row_map, _ = moe_permute.moe_permute_triton(x[:3], ids, 4)
    moe_permute.moe_permute_capacity_triton(x[:3], ids, 4, 2)
    moe_permute.moe_permute_backward_triton(rows, row_map, 2)
    moe_permute.moe_unpermute_triton(rows, row_map, probs)
    moe_permute.moe_unpermute_backward_triton(x[:3], rows, row_map, probs)
    logits = mk(5, 16)
    moe_router.moe_router_triton(logits, torch.zeros(16), 4, "sigmoid", 4, 2, True, 2.5)
    moe_router.moe_router_triton(logits, None, 2, "softmax", 1, 1, False, 1.0)
    moe_router.moe_router_backward_triton(torch.rand(5, 4), logits, torch.randint(0, 16, (5, 4)), "sigmoid", True, 2.5)
    moe_router.moe_router_backward_triton(torch.rand(5, 4), logits, torch.randint(0, 16, (5, 4)), "softmax", False, 1.0)


def _recorded_launches():
    recorder = _Recorder()
    _common.on = recorder.on
    # outputs stay unwritten: give the code after a launch something valid to count
    moe_router._counts = lambda ids, e: torch.zeros(e, dtype=torch.int64)
    # block sizes as chosen for cuda tensors
    gqa._blocks = lambda device, d: (64, 64, _common.block_for(d))
    linear_cross_entropy._block_v = lambda device, v: _common.block_for(v, hi=4096)
    for dtype in (torch.bfloat16, torch.float16):
        _run_all_triton_paths(dtype)
    return recorder.launches


def compile_all() -> list[str]:
    """Compiles every recorded launch; returns one line per failure."""
    launches = _recorded_launches()
    names = {key[0] for key in launches}
    if len(names) < 15:
        return [f"only {len(names)} kernels recorded: {sorted(names)}"]
    failures = []
    for (name, _, _), (fn, signature, constexprs, options) in sorted(launches.items(), key=lambda kv: kv[0][0]):
        try:
            compiled = triton.compile(ASTSource(fn=JITFunction(fn), signature=signature, constexprs=constexprs),
                                      target=TARGET, options=options or None)
            assert "cubin" in compiled.asm
        except Exception as exc:  # collect them all: one report names every broken kernel
            failures.append(f"{name} {signature} {constexprs}: {type(exc).__name__}: {str(exc)[:400]}")
    print(f"compiled {len(launches)} launches of {len(names)} kernels, {len(failures)} failed")
    return failures


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    errors = compile_all()
    print("\n".join(errors))
    sys.exit(1 if errors else 0)
