"""How far torch.compile (Inductor) itself drifts from eager in check_plan's loop.

The measurement behind `tests.helpers.drift_tol`: one process, the preset built as the
parity tests build it, compiled with `torch.compile` and run beside an eager copy for 3
AdamW steps (lr 1e-2, eps 1e-6) on the same batches of 16 x 16 tokens, each step's loss
accumulated over 2 micro-batches. Per step it prints the worst gradient error and, after
the update, the worst parameter error, both `floored_err` (relative to the reference's
norm, floored at 1e-3 of the largest norm of its kind) as the parity tests measure them.
A Hugging Face model of test_hf_ep_forms (`gpt_oss`, ...) is built as that test builds it
and run as its loop runs it: its AdamW lr, 4 x 16 tokens a step.

    PYTHONPATH=. python -m tests.inductor_drift [llama-tiny|moe-tiny|gpt_oss|...]
"""
from __future__ import annotations

import copy
import sys

import torch

import models
from tests.runtime.test_pipeline_exec import floored_err, largest_norm


def worst(model, reference, attr: str | None) -> tuple[float, str]:
    """The largest `floored_err` over the model's parameters (or their gradients)."""
    scale = largest_norm(reference, attr)
    pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
    return max((floored_err(getattr(p, attr) if attr else p, getattr(q, attr) if attr else q,
                            scale), name)
               for (name, p), q in pairs if p.requires_grad)


def drift(name: str, steps: int = 3) -> list[tuple[float, float]]:
    """(worst gradient error, worst parameter error after the update) per step."""
    from tests.parallel.test_hf_ep_forms import MODELS
    torch.manual_seed(0)
    if name in MODELS:
        make, lr = MODELS[name]
        model, rows_per_step = make(), 4
    else:
        model, lr, rows_per_step = models.build_model(name), 1e-2, 16
    for pname, param in model.named_parameters():
        if pname.endswith("attn.wk.bias"):  # as check_plan: its gradient is rounding noise
            param.requires_grad_(False)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(steps):
        tokens = torch.randint(0, 256, (rows_per_step, 16), generator=g)
        targets = torch.randint(0, 256, (rows_per_step, 16), generator=g)
        for fn in (compiled, reference):
            sum(fn(x, y) / 2 for x, y in zip(tokens.chunk(2), targets.chunk(2),
                                              strict=True)).backward()
        grad_err, grad_name = worst(model, reference, "grad")
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
        param_err, param_name = worst(model, reference, None)
        print(f"{name} step {i}: gradients {grad_err:.2e} ({grad_name}), "
              f"parameters after it {param_err:.2e} ({param_name})")
        rows.append((grad_err, param_err))
    return rows


if __name__ == "__main__":
    for preset in sys.argv[1:] or ["llama-tiny", "moe-tiny"]:
        drift(preset)
