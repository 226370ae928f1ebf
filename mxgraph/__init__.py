"""mxgraph: compile a PyTorch training step into graphs, rewrite them with passes, run them.

    import mxgraph as mx
    step = mx.compile(model, mx.Plan())
    loss = step(tokens, targets)   # fills .grad of step.parameters()
"""
from mxgraph.compile import Step, compile  # noqa: A004
from mxgraph.errors import PlanError, TraceError
from mxgraph.plan import MoEOptions, OverlapOptions, Plan
from mxgraph.runtime.health import Guard, NonFiniteError

__all__ = ["Guard", "MoEOptions", "NonFiniteError", "OverlapOptions", "Plan", "PlanError", "Step",
           "TraceError", "compile"]
