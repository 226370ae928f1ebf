"""Helpers shared by tests: compare a compiled step with the eager model."""
from __future__ import annotations

import copy

import torch


def batch(vocab: int = 256, batch_size: int = 2, seq_len: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    targets = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return tokens, targets


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def eager_step(model, *args):
    """Reference: loss and grads of the eager model."""
    model.zero_grad(set_to_none=True)
    loss = model(*args)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads_close(model, reference, tol: float) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{name}: eager has no gradient, compiled has one"
            continue
        assert p.grad is not None, f"{name}: compiled step left no gradient"
        err = rel_err(p.grad, q.grad)
        assert err <= tol, f"{name}: gradient relative error {err:.2e} > {tol:.0e}"


def twin(model):
    return copy.deepcopy(model)
