"""Flash Fusion: matched op chains of the forward graph become fused custom ops.

Owns: the pass (`fuse.py`, `PATTERNS` in the order they run), the toolkit the patterns are
written with (`rewriter.py`: `Pattern`, `Match`, `Rewriter`), the pattern families
(`elementwise.py`: SwiGLU, bias-GELU, bias-dropout-add; `attention.py`: RoPE, Repeat-GQA;
`norm.py`: RMSNorm, linear + cross-entropy; `moe.py`: router, permute/unpermute), and the
joint-graph fold of a residual gradient into the fused norm's backward (`residual_grad.py`).

May import: `mxgraph.ir`, `errors`, `plan`, `context` and the fused kernels it inserts
(`mxgraph.codegen.kernels`). Not the other pass packages.
"""
