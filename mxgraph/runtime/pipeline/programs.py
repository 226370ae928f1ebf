"""What the executor runs: a stage's F, B and W programs and the data between them.

A `Program` is a piece of a stage's joint graph (`passes/split_bw.py` cuts it): it reads
joint-graph nodes from an environment (`dict[Node, Tensor]`, one per stage and micro-batch)
and writes the nodes it computes back. Codegen gives each program its generated function
(`fn`); until then it runs its fx GraphModule.

Outputs listed in `announce` are handed to `on_ready(node, value)` the moment the program
computes them, while the rest of it still runs (codegen writes the call after the node's
line): the executor hears of each parameter gradient as soon as it exists, so that a
data-parallel bucket can start its reduction during the backward. Inputs listed in
`needs` go to `on_need(node)` right before the program's first use of them: a ZeRO-1
parameter is then waited for only where the step reads it.

With a level-1 monitor (`Step.set_monitor`), `points` lists where the generated code calls
`point(i, section)`: the start of each segment a `runtime.monitor.slow_node.ProgramTimer` (the
program's `clock`) times as one section (a layer's compute, a collective, the wait for
its group); without, the code has no such calls.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node


@dataclass(frozen=True)
class TimingPoint:
    """Where a segment of a program starts (right before `node` of its graph) and what
    it is timed as: `section` ("fwd:layer 3", "all_reduce of layer 3", ...), `kind`
    ("compute", "comm", "wait"), `group`: the process-group name whose ranks meet at the
    start of a "wait" segment (None: no meeting)."""

    node: Node
    section: str
    kind: str
    group: str | None = None


@dataclass
class Program:
    """A piece of a joint graph: reads `inputs` and writes `outputs` (joint nodes)."""

    gm: GraphModule
    inputs: list[Node]
    outputs: list[Node]
    fn: object = None
    """The generated function (codegen); None runs `gm`."""
    source: str = ""
    """The generated Python source (codegen)."""
    announce: tuple[Node, ...] = ()
    """Outputs whose values go to `on_ready` as soon as they are computed."""
    announce_buckets: tuple[int, ...] = ()
    """The data-parallel bucket of each `announce` entry (() when unknown): a bucket starts
    once its last gradient is in, so a codegen that batches the announcements
    (`codegen/segments.py`) keeps those last ones on time."""
    on_ready: object = None
    """`on_ready(node, value)`, set by the executor for the run at hand; None: silent."""

    needs: tuple[Node, ...] = ()
    """Inputs announced to `on_need(node)` right before the program first reads them."""
    on_need: object = None
    """`on_need(node)`, set by the executor for the run at hand (a ZeRO-1 parameter whose
    all-gather is still in flight is waited for there); None: silent."""

    def need(self, index: int) -> None:
        """Called by the generated code right before `needs[index]` is first read."""
        if self.on_need is not None:
            self.on_need(self.needs[index])

    def ready(self, index: int, value: torch.Tensor) -> None:
        """Called by the generated code when `announce[index]` is computed."""
        if self.on_ready is not None:
            self.on_ready(self.announce[index], value)

    points: tuple[TimingPoint, ...] = ()
    """Timing points the generated code calls (`passes/monitor_points.py`); () without."""
    clock: object = None
    """The `runtime.monitor.slow_node.ProgramTimer` timing the run at hand (set by the executor for
    a level-1 monitor); None: the points do nothing."""

    def point(self, index: int) -> None:
        """Called by the generated code where segment `points[index]` starts."""
        if self.clock is not None:
            self.clock.point(index)

    steps_fn: object = None
    """The generated function as a generator that pauses right before each wait for a
    collective (codegen); None: `steps` runs the program whole."""

    def run(self, env: dict[Node, torch.Tensor]) -> None:
        values = (self.fn or self.gm)(*[env[n] for n in self.inputs])
        if self.clock is not None:
            self.clock.end()
        env.update(zip(self.outputs, values, strict=True))

    def steps(self, env: dict[Node, torch.Tensor]):
        """Run the program as a generator that yields where it is about to wait for a
        collective it started (so another program can run meanwhile)."""
        if self.steps_fn is None:
            self.run(env)
            return
        work = self.steps_fn(*[env[n] for n in self.inputs])
        if self.clock is None:
            values = yield from work
        else:
            values = yield from self.clock.paused(work)
            self.clock.end()
        env.update(zip(self.outputs, values, strict=True))


@dataclass
class StagePrograms:
    """One stage's joint graph cut in three: F (forward), B (input gradients), W (weight
    gradients); run in that order they compute what the joint graph computes."""

    forward: Program
    backward_input: Program  # B
    backward_weight: Program  # W
    placeholders: list[Node]  # joint placeholders, in JointGraph.inputs order
    forward_outputs: list[Node]
    input_grads: dict[int, Node]  # activation index -> its gradient node
    param_grads: list[tuple[str, Node]]  # (parameter name, gradient node)

    def all(self) -> tuple[tuple[str, Program], ...]:
        """(kind, program) for F, B and W."""
        return (("F", self.forward), ("B", self.backward_input), ("W", self.backward_weight))

    @functools.cached_property
    def weight_reads(self) -> frozenset[Node]:
        """The values a micro-batch still needs once its B ran: W's inputs and the parameter
        gradients (B may have made some)."""
        return frozenset(self.backward_weight.inputs) | {node for _, node in self.param_grads}


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `param.grad` as autograd's AccumulateGrad does."""
    if grad.stride() != param.stride():
        grad = grad.clone(memory_format=torch.contiguous_format)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
