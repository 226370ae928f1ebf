"""The compile driver (mxgraph/driver.py): one pipeline for every plan and caller; the B/W
split's bitwise claim; micro-batches of keyword inputs; allocations on the mesh's device."""
import copy

import pytest
import torch

import models
import mxgraph as mx
from mxgraph.context import CompileContext
from mxgraph.driver import compile_step
from mxgraph.errors import PlanError
from mxgraph.passes.pipeline import PIPELINE
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.runtime.pipeline.executor import PipelineRun
from mxgraph.schedules import RECV_F
from tests.helpers import assert_grads_close, batch, rel_err


def test_keyword_tensor_input_is_split_into_micro_batches():
    """Traced and run at the micro-batch size alike: a keyword `targets` under
    micro_batches=4 gives eager's loss and gradients (fp32: 1e-5 loss, 1e-5 grads)."""
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=2)
    reference = copy.deepcopy(model)
    tokens, targets = batch(batch_size=8, seq_len=16)
    step = mx.compile(model, mx.Plan(micro_batches=4))
    loss = step(tokens, targets=targets)
    expected = reference(tokens, targets=targets)
    expected.backward()
    assert rel_err(loss, expected.detach()) <= 1e-5
    assert_grads_close(model, reference, 1e-5)


def _joint_inputs(model, runtime, args, seed):
    """Real tensors for a stage's joint graph: parameters, random activations, the user
    inputs and random tangents."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    values = []
    for node, slot in zip(runtime.programs.placeholders, runtime.slots, strict=True):
        meta = node.meta["val"]
        if slot.kind == "param":
            values.append(params[slot.key])
        elif slot.kind == "buffer":
            values.append(buffers[slot.key])
        elif slot.kind == "constant":
            values.append(runtime.constants[slot.key])
        elif slot.kind == "input" and slot.key >= runtime.num_activations:
            values.append(args[runtime.user_inputs[slot.key - runtime.num_activations]])
        else:  # a received activation or an incoming gradient
            values.append(torch.randn(meta.shape, generator=g, dtype=meta.dtype))
    return values


@pytest.mark.parametrize("stage", [0, 1])
def test_f_b_w_programs_are_bitwise_the_joint_graph(stage):
    """split_bw's claim, with dropout on (random ops run once, in F): each stage's F, B, W
    in order compute exactly (torch.equal) the joint graph's outputs."""
    torch.manual_seed(0)
    model = models.build_model("gpt-tiny", n_layers=2, dropout=0.1)
    args = list(batch(seq_len=16))
    plan = mx.Plan(pp=2, micro_batches=2)
    mesh = Mesh.on_paper(pp=2)
    mesh.coords["pp"] = stage
    compilation = compile_step(model, plan, mesh, CompileContext(plan=plan, mesh=mesh),
                               tuple(args), {}, stop_after="codegen")
    runtime = compilation.executor.stages[stage]
    values = _joint_inputs(model, runtime, [a[:1] for a in args], seed=stage)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = runtime.joint.gm(*values)
    env = dict(zip(runtime.programs.placeholders, values, strict=True))
    torch.manual_seed(7)
    with torch.no_grad():
        for _, program in runtime.programs.all():
            program.run(env)
    outputs = list(runtime.joint.gm.graph.find_nodes(op="output")[0].args[0])
    checked = 0
    for node, value in zip(outputs, expected, strict=True):
        if node is None:
            continue
        assert torch.equal(env[node], value), node.name
        checked += 1
    assert checked > 10  # the stage outputs and every parameter gradient


def test_stop_after_ends_the_pipeline_there():
    model = models.build_model("llama-tiny", n_layers=1)
    plan = mx.Plan()
    mesh = Mesh.on_paper()
    ctx = CompileContext(plan=plan, mesh=mesh)
    compilation = compile_step(model, plan, mesh, ctx, batch(seq_len=8), {}, stop_after="grad")
    assert compilation.joints and not compilation.programs and compilation.executor is None
    names = [r["pass"] for r in ctx.records]
    assert names == [s.name for s in PIPELINE[:names.index("grad") + 1]]
    with pytest.raises(PlanError, match="no step of the pipeline"):
        compile_step(model, plan, mesh, ctx, batch(seq_len=8), {}, stop_after="gard")


def test_structural_steps_cannot_be_disabled():
    with pytest.raises(PlanError, match="cannot be disabled"):
        mx.compile(models.build_model("llama-tiny", n_layers=1),
                   mx.Plan(disable_passes=("grad",)))


class _Recorder:
    """Stands in for torch.empty/torch.zeros: records the device each call asks for."""

    def __init__(self, real):
        self.real, self.devices = real, []

    def __call__(self, *shape, dtype=None, device=None, **kwargs):
        self.devices.append(device)
        return self.real(*shape, dtype=dtype, **kwargs)


class _Done:
    def wait(self):
        return None


def test_pipeline_executor_allocates_on_the_mesh_device(monkeypatch):
    """Receive buffers and the loss of a rank without the last stage go on mesh.device (a
    `cuda` mesh here, on a CPU machine: the calls are recorded, not run on a GPU)."""
    model = models.build_model("llama-tiny", n_layers=2)
    plan = mx.Plan(pp=2, micro_batches=2)
    mesh = Mesh.on_paper(pp=2)
    mesh.coords["pp"] = 1
    compilation = compile_step(model, plan, mesh, CompileContext(plan=plan, mesh=mesh),
                               batch(seq_len=8), {}, stop_after="codegen")
    executor = compilation.executor
    executor.mesh.device = torch.device("cuda", 0)
    empty, zeros = _Recorder(torch.empty), _Recorder(torch.zeros)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.distributed, "irecv", lambda *a, **k: _Done())
    executor.recv(PipelineRun([]), RECV_F, 1, 0)
    assert empty.devices and all(d == torch.device("cuda", 0) for d in empty.devices)
    executor.mesh.coords["pp"] = 0  # a rank without the last stage makes its loss itself
    executor.mesh.sizes["pp"] = 1  # (no broadcast on a paper mesh)
    executor.schedule.actions[0] = []
    executor.step([])
    assert zeros.devices == [torch.device("cuda", 0)]
