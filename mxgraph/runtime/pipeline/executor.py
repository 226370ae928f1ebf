"""The pipeline executor: runs a rank's F/B/W programs in schedule order.

Per rank, the schedule (`mxgraph.schedules`) lists actions. The executor keeps, per
(stage, micro-batch), a dict of joint-graph node -> tensor (`env`): F fills it, B and W
read it, W drops it. Activations and their gradients move with asynchronous
`isend`/`irecv` (the schedules assume sends do not block); a stage whose neighbour
lives on the same rank (DualPipeV's turn) hands tensors over in memory. With
`Plan.overlap.p2p`, receives are posted ahead and sends batched (`runtime/pipeline/p2p.py`). Each
compute action runs as a generator that pauses where a program waits for a collective
(`Program.steps`): an overlapped F&B pair (DualPipeV) runs its two parts in turn between
those pauses (`interleave`), so one computes while the other's transfer is on the wire.

After the last action: the loss (mean over micro-batches) is broadcast from the rank
that computed it over the pipeline group; gradients of parameters held by several
stages on different ranks (tied embeddings) are summed over those ranks; with dp > 1,
gradients are averaged over the data-parallel group.

With a monitor (`set_monitor`, `runtime/monitor/slow_node.py`) the executor times its compute
actions as "forward_backward", P2P receives, the final wait for sends and the loss
broadcast as "pipeline_wait", the sum of shared gradients as "grad_sync"; at level 1 each
program's timing points time its layers and collectives (`Program.clock`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mxgraph.capture import model_tensors, slot_tensor
from mxgraph.errors import PlanError
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.runtime.monitor.slow_node import timed
from mxgraph.runtime.pipeline.p2p import P2PQueue, RecvSpec
from mxgraph.runtime.pipeline.programs import StagePrograms, accumulate_grad
from mxgraph.schedules import BW, OVERLAP_F_B, RECV_F, SEND_B, SEND_F, Action, B, F, Schedule, W

_KIND_CODES = {SEND_F: 0, SEND_B: 1}


def interleave(works: list) -> int:
    """Run generators in turn, each up to its next pause (a collective in flight), until
    all are done: DualPipeV's overlapped F&B pair, where one part computes while the
    other's collective is on the wire. The order is fixed, so every rank of a group issues
    its collectives in the same order; values are those of running the parts in turn.
    Returns how often a part paused while another still had work (the hand-overs)."""
    works, handovers = list(works), 0
    while works:
        for work in list(works):
            try:
                next(work)
                handovers += len(works) > 1
            except StopIteration:
                works.remove(work)
    return handovers


def split_microbatches(inputs: list, num_microbatches: int) -> list[list]:
    """Chunk every tensor input (the flattened positional and keyword inputs alike) along
    dim 0; other inputs are shared by all chunks."""
    chunks = []
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % num_microbatches:
                raise PlanError(f"micro_batches={num_microbatches} does not divide the batch "
                                f"size {value.shape[0]}; choose a divisor of it")
            chunks.append(value.chunk(num_microbatches))
        else:
            chunks.append([value] * num_microbatches)
    return [list(mb) for mb in zip(*chunks, strict=True)]


@dataclass
class StageRuntime:
    """What the executor needs of one stage held by this rank."""

    programs: StagePrograms
    slots: list  # JointGraph.inputs
    num_activations: int
    user_inputs: list[int]  # flattened user input index per "user" activation slot
    activation_meta: list[torch.Tensor]  # fake tensors: shapes of received activations
    output_meta: list[torch.Tensor]  # fake tensors: shapes of this stage's outputs
    constants: dict
    joint: object = None
    """The stage's joint graph (`joint.JointGraph`) the programs were cut from, after the
    joint passes: for analyses (saved activations, communication)."""

    @functools.cached_property
    def grad_names(self) -> dict:
        """Gradient node -> the parameter names it is the gradient of."""
        names: dict = {}
        for name, node in self.programs.param_grads:
            names.setdefault(node, []).append(name)
        return names


@dataclass
class PipelineRun:
    """State of one step on one rank."""

    microbatches: list[list]
    env: dict = field(default_factory=dict)  # (stage, mb) -> {node: tensor}
    acts_in: dict = field(default_factory=dict)  # (stage, mb) -> received activations
    grads_in: dict = field(default_factory=dict)  # (stage, mb) -> received output grads
    acts_out: dict = field(default_factory=dict)
    grads_out: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    losses: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)  # name -> parameter (tied ones by each name)
    announced: dict = field(default_factory=dict)  # (stage, mb) -> gradient nodes accumulated
    grads_left: dict = field(default_factory=dict)  # id(param) -> final accumulations to come
    last_weight_mb: dict = field(default_factory=dict)  # PipelineExecutor.last_weight_mb


class PipelineExecutor:
    """Runs one training step of this rank's stages (see the module docstring); without
    pipelining, of the one stage, for every micro-batch. Tensors it allocates (receive
    buffers, missing gradients, the loss of ranks without the last stage) go on
    `mesh.device`."""

    def __init__(self, model: torch.nn.Module, schedule: Schedule,
                 stages: dict[int, StageRuntime], mesh: Mesh,
                 shared_params: list[tuple[str, set[int]]], loss_meta: torch.Tensor,
                 p2p_ahead: bool = False):
        self.model = model
        self.schedule = schedule
        self.stages = stages
        self.mesh = mesh
        self.shared_params = shared_params
        """(parameter name, pipeline ranks holding it) for parameters several ranks use."""
        self.loss_meta = loss_meta
        """The last stage's loss (a fake tensor: its dtype)."""
        self.p2p_ahead = p2p_ahead
        """Post receives ahead of their RECV action and batch each SEND's tensors
        (`runtime/pipeline/p2p.py`; `Plan.overlap.p2p`). Bitwise-equal to off."""
        self.p2p_in_issue_order = mesh.device.type != "cpu"
        """Whether the backend runs this rank's transfers in issue order (nccl/mccl; gloo on
        the CPU matches on source and tag): then receives are posted no earlier than after
        the sends listed before them (`p2p.post_points`)."""
        self._p2p: P2PQueue | None = None  # the running step's transfers, with p2p_ahead

    monitor = None
    """The `runtime.monitor.slow_node.StepMonitor` timing this executor's steps (`set_monitor`);
    None: untimed."""

    def set_monitor(self, monitor) -> None:
        """Time steps into `monitor` (None: stop). At level 1 every program with timing
        points gets a clock (`ProgramTimer`); programs compiled without points time only
        the level-0 sections."""
        self.monitor = monitor
        timing = monitor is not None and monitor.cfg.level >= 1
        for rt in self.stages.values():
            for _, program in rt.programs.all():
                program.clock = monitor.program_timer(
                    [(p.section, p.kind, p.group) for p in program.points]) \
                    if timing and program.points else None

    @property
    def timing_points(self) -> bool:
        """Whether the generated programs call timing points (compiled for level 1)."""
        return any(p.points for rt in self.stages.values() for _, p in rt.programs.all())

    def model_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of the model's parameters this rank's stages read, each once
        (a tied weight under its first name)."""
        names = {slot.key for rt in self.stages.values() for slot in rt.slots
                 if slot.kind == "param"}
        held = {id(p) for n, p in self.model.named_parameters(remove_duplicate=False)
                if n in names}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) in held]

    # ---- helpers ----------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.mesh.rank_at(pp=self.schedule.stage_to_rank[stage])

    def _local(self, stage: int) -> bool:
        return self.schedule.stage_to_rank[stage] == self.mesh.coords["pp"]

    def _tag(self, kind: str, stage: int, mb: int) -> int:
        return (_KIND_CODES[kind] * self.schedule.num_stages + stage) * \
            self.schedule.num_microbatches + mb

    # ---- actions ----------------------------------------------------------------------
    def forward(self, run: PipelineRun, stage: int, mb: int):
        """F of (stage, mb); a generator that pauses where the program waits for a
        collective (`Program.steps`): `do` drains it, an overlapped pair interleaves two."""
        rt = self.stages[stage]
        env = run.env[(stage, mb)] = {}
        tensors = model_tensors(self.model)
        activations = run.acts_in.pop((stage, mb), [])
        inputs = run.microbatches[mb]
        for node, slot in zip(rt.programs.placeholders, rt.slots, strict=True):
            if slot.kind in ("param", "buffer", "constant"):
                env[node] = slot_tensor(slot, tensors, rt.constants)
            elif slot.kind == "input":
                env[node] = activations[slot.key] if slot.key < rt.num_activations else \
                    inputs[rt.user_inputs[slot.key - rt.num_activations]]
        yield from rt.programs.forward.steps(env)
        outputs = [env[n] for n in rt.programs.forward_outputs]
        if stage == self.schedule.num_stages - 1:
            run.losses[mb] = outputs[0]
        elif self._local(stage + 1):
            run.acts_in[(stage + 1, mb)] = outputs
        else:
            run.acts_out[(stage, mb)] = outputs

    def backward_input(self, run: PipelineRun, stage: int, mb: int):
        """B of (stage, mb); a generator, as `forward`."""
        rt = self.stages[stage]
        env = run.env[(stage, mb)]
        if stage == self.schedule.num_stages - 1:
            loss = env[rt.programs.forward_outputs[0]]
            grads = [torch.full_like(loss, 1.0 / self.schedule.num_microbatches)]
        else:
            grads = run.grads_in.pop((stage, mb))
        for node, slot in zip(rt.programs.placeholders, rt.slots, strict=True):
            if slot.kind == "tangent":
                env[node] = grads[slot.key]
        yield from self._run_backward(run, stage, mb, rt.programs.backward_input)
        if stage > 0:
            input_grads = [env[rt.programs.input_grads[i]] if i in rt.programs.input_grads
                           else torch.zeros(rt.activation_meta[i].shape,
                                             dtype=rt.activation_meta[i].dtype,
                                             device=self.mesh.device)
                           for i in range(rt.num_activations)]
            if self._local(stage - 1):
                run.grads_in[(stage - 1, mb)] = input_grads
            else:
                run.grads_out[(stage, mb)] = input_grads
        # from B to W a micro-batch holds only what W reads: the values F saved for B alone
        # are freed now, not at W (what a zero-bubble schedule's deferred W costs in memory)
        keep = rt.programs.weight_reads
        for node in [n for n in env if n not in keep]:
            del env[node]

    def backward_weight(self, run: PipelineRun, stage: int, mb: int):
        """W of (stage, mb); a generator, as `forward`."""
        rt = self.stages[stage]
        env = run.env[(stage, mb)]
        yield from self._run_backward(run, stage, mb, rt.programs.backward_weight)
        run.env.pop((stage, mb))
        announced = run.announced.pop((stage, mb), ())
        for name, node in rt.programs.param_grads:
            if node not in announced:
                self._accumulate(run, stage, mb, name, env[node])

    # ---- gradients as they land (Plan.overlap.dp_buckets) ------------------------------
    grad_ready = None
    """`grad_ready(parameter)`, set by the step for one run: called when this rank's
    gradient of the parameter is final (the last micro-batch of every stage of this rank
    that reads it, under any of its names, accumulated it), while the backward still runs
    (`runtime/data_parallel/overlap.py`). None: not called."""

    handovers = 0
    """How often an overlapped F&B pair switched from one part to the other at a collective
    wait (`interleave`), over the executor's steps so far."""

    param_needed = None
    """`param_needed(parameter)`, set by the step for one run: called right before a
    program first reads the parameter (ZeRO-1's all-gather of it may still be in flight:
    `runtime/data_parallel/overlap.py`). None: not called."""

    def _listen_for_parameters(self, callback) -> None:
        """Route every program's `on_need` to `callback(parameter)` (None: off)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for rt in self.stages.values():
            held = {node: params[slot.key] for node, slot in
                    zip(rt.programs.placeholders, rt.slots, strict=True) if slot.kind == "param"}
            for _, program in rt.programs.all():
                program.on_need = None if callback is None or not program.needs else \
                    (lambda node, held=held: callback(held[node]))

    def _run_backward(self, run: PipelineRun, stage: int, mb: int, program):
        """Run a B or W program (a generator); with `grad_ready`, each parameter gradient
        it computes is accumulated the moment it exists (`Program.announce`)."""
        env = run.env[(stage, mb)]
        if self.grad_ready is None or not program.announce:
            yield from program.steps(env)
            return
        names = self.stages[stage].grad_names
        announced = run.announced.setdefault((stage, mb), set())

        def on_ready(node, value):
            announced.add(node)
            for name in names[node]:
                self._accumulate(run, stage, mb, name, value)
        program.on_ready = on_ready
        try:
            yield from program.steps(env)
        finally:
            program.on_ready = None

    master = None
    """bf16-mixed: the step's `runtime/precision.MasterWeights`; parameter gradients are
    added into its fp32 main gradients instead of `.grad` (None: into `.grad`)."""

    def _accumulate(self, run: PipelineRun, stage: int, mb: int, name: str, grad) -> None:
        if self.master is None:
            accumulate_grad(run.params[name], grad)
        else:
            self.master.accumulate(run.params[name], grad)
        if self.grad_ready is None or run.last_weight_mb.get(stage) != mb:
            return
        param = run.params[name]
        run.grads_left[id(param)] -= 1
        if not run.grads_left[id(param)]:
            self.grad_ready(param)

    @functools.cached_property
    def last_weight_mb(self) -> dict[int, int]:
        """stage -> the micro-batch of this rank's last W (or BW) action of that stage."""
        last = {}
        for action in self.schedule.actions[self.mesh.coords["pp"]]:
            for part in action.compute_parts():
                if part.kind in (W, BW):
                    last[part.stage] = part.microbatch
        return last

    def send(self, run: PipelineRun, kind: str, stage: int, mb: int) -> None:
        tensors = (run.acts_out if kind == SEND_F else run.grads_out).pop((stage, mb))
        peer = self._peer(stage + 1 if kind == SEND_F else stage - 1)
        if self._p2p is not None:
            run.sends += self._p2p.send(Action(stage, kind, mb), peer,
                                        self._tag(kind, stage, mb), tensors)
            return
        for tensor in tensors:
            run.sends.append(dist.isend(tensor.contiguous(), peer,
                                        tag=self._tag(kind, stage, mb)))

    def recv(self, run: PipelineRun, kind: str, stage: int, mb: int) -> None:
        if self._p2p is not None:
            buffers = self._p2p.take(Action(stage, kind, mb))
        else:
            spec = self._recv_spec(Action(stage, kind, mb))
            buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.mesh.device)
                       for m in spec.metas]
            for buffer in buffers:
                dist.irecv(buffer, spec.peer, tag=spec.tag).wait()
        (run.acts_in if kind == RECV_F else run.grads_in)[(stage, mb)] = buffers

    def _recv_spec(self, action: Action) -> RecvSpec:
        """From whom, under which tag and into what shapes a RECV_F/RECV_B reads."""
        stage, mb = action.stage, action.microbatch
        if action.kind == RECV_F:
            metas, sender, sent_kind = self.stages[stage].activation_meta, stage - 1, SEND_F
        else:
            metas, sender, sent_kind = self.stages[stage].output_meta, stage + 1, SEND_B
        return RecvSpec(self._peer(sender), self._tag(sent_kind, sender, mb), metas)

    def compute(self, run: PipelineRun, action: Action):
        """The programs of a compute action, as one generator (pausing at collective waits)."""
        kind, stage, mb = action.kind, action.stage, action.microbatch
        if kind in (F, B, W):
            work = {F: self.forward, B: self.backward_input, W: self.backward_weight}[kind]
            yield from work(run, stage, mb)
        else:  # BW
            yield from self.backward_input(run, stage, mb)
            yield from self.backward_weight(run, stage, mb)

    def do(self, run: PipelineRun, action: Action) -> None:
        kind, stage, mb = action.kind, action.stage, action.microbatch
        if kind in (F, B, W, BW):
            with torch.no_grad(), timed(self.monitor, "forward_backward", "compute"):
                for _ in self.compute(run, action):
                    pass
        elif kind == OVERLAP_F_B:
            with torch.no_grad(), timed(self.monitor, "forward_backward", "compute"):
                self.handovers += interleave([self.compute(run, part) for part in action.parts])
        elif kind in (SEND_F, SEND_B):
            self.send(run, kind, stage, mb)
        else:
            with timed(self.monitor, "pipeline_wait", "wait"):
                self.recv(run, kind, stage, mb)

    # ---- one step ---------------------------------------------------------------------
    def step(self, microbatches: list[list], training: bool = True) -> torch.Tensor:
        """One step over `microbatches`; the mean loss. `training=False` runs only the
        forward actions of the schedule (and their sends), for an executor compiled
        without gradients (`evaluate`)."""
        run = PipelineRun(microbatches)
        run.params = dict(self.model.named_parameters(remove_duplicate=False))
        if self.grad_ready is not None:  # the bookkeeping of gradients as they land
            run.last_weight_mb = self.last_weight_mb
            for rt in self.stages.values():
                for name, _ in rt.programs.param_grads:
                    key = id(run.params[name])
                    run.grads_left[key] = run.grads_left.get(key, 0) + 1
        actions = self.schedule.actions[self.mesh.coords["pp"]]
        if not training:
            actions = [part for action in actions for part in action.compute_parts() or (action,)
                       if part.kind in (F, SEND_F, RECV_F)]
        self._p2p = P2PQueue(actions, self._recv_spec, device=self.mesh.device,
                             in_issue_order=self.p2p_in_issue_order) if self.p2p_ahead else None
        listening = self.param_needed is not None
        if listening:
            self._listen_for_parameters(self.param_needed)
        try:
            for action in actions:
                if self._p2p is not None:
                    self._p2p.post_due(action)
                self.do(run, action)
                if not training and action.kind == F:
                    run.env.pop((action.stage, action.microbatch), None)
        finally:
            self._p2p = None
            if listening:
                self._listen_for_parameters(None)
        if run.sends:
            with timed(self.monitor, "pipeline_wait", "wait"):
                for work in run.sends:
                    work.wait()
        loss = torch.stack([run.losses[m] for m in sorted(run.losses)]).mean() \
            if run.losses else torch.zeros((), dtype=self.loss_meta.dtype, device=self.mesh.device)
        if self.mesh.sizes["pp"] > 1:
            loss = loss.detach().clone()
            with timed(self.monitor, "pipeline_wait", "wait"):
                dist.broadcast(loss, self._peer(self.schedule.num_stages - 1),
                               group=self.mesh.group("pp"))
            if training and self.shared_params:
                with timed(self.monitor, "grad_sync", "comm"):
                    self._sum_shared_grads()
        return loss.detach()

    def _sum_shared_grads(self) -> None:
        """Sum gradients of parameters used by stages on several ranks (every pipeline
        rank joins each all-reduce; ranks without the parameter add zeros)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, holders in self.shared_params:
            param = params[name]
            held = self.mesh.coords["pp"] in holders
            mine = param.grad if self.master is None else self.master.grad_of(param)
            grad = mine if held and mine is not None else torch.zeros_like(
                param, dtype=param.dtype if self.master is None else torch.float32)
            dist.all_reduce(grad, group=self.mesh.group("pp"))
            if held and self.master is None:
                param.grad = grad
            elif held:
                self.master.set_grad(param, grad)
