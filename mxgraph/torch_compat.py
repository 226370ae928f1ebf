"""Names that moved between torch releases, so mxgraph also runs on the torch a GPU image
ships (2.11 on the H200 images this project is checked on). The project pins and tests
torch 2.13 (pyproject); each fallback here is the older spelling of the same thing."""
from __future__ import annotations

try:  # torch >= 2.12
    from torch.fx.experimental.symbolic_shapes import has_guarding_hint
except ImportError:  # torch 2.11: a size with a hint can be guarded on
    from torch.fx.experimental.symbolic_shapes import has_hint as has_guarding_hint

__all__ = ["has_guarding_hint"]
