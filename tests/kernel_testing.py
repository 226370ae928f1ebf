"""Test helpers for the fused kernels (used by tests/kernels/test_*.py)."""

from __future__ import annotations

import torch

# (atol, rtol) per dtype for Triton-vs-reference comparisons of elementwise kernels. Both
# paths compute in fp32 and round once, so fp16 outputs may differ by about one fp16 ulp.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict | None = None, msg: str = ""):
    """Compare with the tolerance of ``expected``'s dtype; NaN anywhere in ``actual`` fails
    (outputs are poisoned with NaN before the kernel runs)."""
    tol = tol or ELEMENTWISE_TOL
    atol, rtol = tol.get(expected.dtype, tol.get(torch.float32))
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    if actual.dtype.is_floating_point:
        assert not torch.isnan(actual).any(), f"{msg}: NaN in output (unwritten element?)"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")


def opcheck(op, args, kwargs=None):
    """torch.library.opcheck with every test it offers; raises on the first failure."""
    torch.library.opcheck(op, args, kwargs or {}, raise_exception=True)
