"""`Plan(codegen="inductor")`: each program lowered by Inductor (mxgraph/codegen/inductor.py)
against eager autograd on one process, fp32: the loss of each step within 1e-5 relative,
the gradients of step 1 and the parameters after 2 AdamW steps within 1e-4 (Inductor's
fused loops sum in another order). A 1-layer llama-tiny keeps Inductor's compile (F and W;
one stage has no B: token ids have no gradient) near half a minute on 2 cores. On 2 gloo
ranks: tp2 + SP with its collectives lowered by Inductor (check_plan), and dp2 + ZeRO-1 with
overlap and a level-1 monitor, whose programs are lowered in segments around the executor's
callbacks."""
import copy
import warnings

import pytest
import torch

import models
import mxgraph as mx
from tests.helpers import batch, rel_err


def _run(plan: mx.Plan, steps: int = 2):
    torch.manual_seed(0)
    model = models.build_model("llama-tiny", n_layers=1)
    reference = copy.deepcopy(model)
    step = mx.compile(model, plan)
    opt = torch.optim.AdamW(step.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    for i in range(steps):
        tokens, targets = batch(batch_size=2, seq_len=16, seed=i)
        loss = step(tokens, targets)
        ref_loss = reference(tokens, targets)
        ref_loss.backward()
        assert rel_err(loss, ref_loss.detach()) <= 1e-5, (i, loss.item(), ref_loss.item())
        if i == 0:
            grads = dict(step.named_parameters())
            for name, param in reference.named_parameters():
                assert rel_err(grads[name].grad, param.grad) <= 1e-4, name
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    params = dict(step.named_parameters())
    for name, param in reference.named_parameters():
        assert rel_err(params[name].detach(), param.detach()) <= 1e-4, name
    return step


def test_inductor_codegen_matches_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("MXGRAPH_STRICT", "1")  # a program left to Python codegen would raise
    step = _run(mx.Plan(codegen="inductor", dump_dir=str(tmp_path)))
    programs = {kind: p for ex in step.executors() for rt in ex.stages.values()
                for kind, p in rt.programs.all() if p.inputs}  # one stage: B is empty (token ids have no gradient)
    assert sorted(programs) == ["F", "W"]
    assert all(p.steps_fn is None and p.fn.__name__ == "run" for p in programs.values())
    assert sorted(f.name for f in tmp_path.glob("**/inductor_stage0_*.py")) == [
        "inductor_stage0_F.py", "inductor_stage0_W.py"]


def test_fused_ops_are_fused_into_inductor_loops_on_the_cpu(monkeypatch, tmp_path):
    """Fused ops on the CPU (kinds named: fusion=True leaves swiglu to Inductor there): each
    is traced as its reference (`kernels.cpu_decompositions`), so Inductor's code calls
    none of them as an opaque kernel, and the step still matches eager."""
    monkeypatch.setenv("MXGRAPH_STRICT", "1")
    step = _run(mx.Plan(codegen="inductor", fusion="swiglu,rmsnorm,rope,linear_cross_entropy",
                        dump_dir=str(tmp_path)))
    fused = {n.target for ex in step.executors() for rt in ex.stages.values()
             for _, p in rt.programs.all() for n in p.gm.graph.nodes
             if str(n.target).startswith("mxgraph.")}
    assert {"mxgraph.swiglu.default", "mxgraph.rmsnorm.default"} <= {str(t) for t in fused}
    code = "".join(f.read_text() for f in tmp_path.glob("**/inductor_stage0_*.py"))
    assert "aten." in code or "cpp_fused" in code
    assert "torch.ops.mxgraph" not in code


def test_a_program_inductor_refuses_runs_as_python_and_says_so(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    def refuse(*args, **kwargs):
        raise RuntimeError("no lowering for this op")
    monkeypatch.setattr(compile_fx, "compile_fx_inner", refuse)
    monkeypatch.delenv("MXGRAPH_STRICT", raising=False)  # the fallback this test checks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(mx.Plan(codegen="inductor"), steps=1)
    messages = [str(w.message) for w in caught if "codegen='inductor'" in str(w.message)]
    assert len(messages) == 2, messages  # F and W
    assert "stage 0, F (forward) runs as Python codegen: Inductor refused it: RuntimeError: " \
           "no lowering for this op" in messages[0]
    monkeypatch.setenv("MXGRAPH_STRICT", "1")
    with pytest.raises(mx.TraceError, match="unset MXGRAPH_STRICT to fall back"):
        _run(mx.Plan(codegen="inductor"), steps=1)


def test_unknown_codegen_names_the_choices():
    with pytest.raises(mx.PlanError, match="codegen: 'triton' is unknown; choose from auto, python, inductor"):
        mx.Plan(codegen="triton")


def test_auto_codegen_is_inductor_where_it_generates_code(monkeypatch):
    monkeypatch.delenv("MXGRAPH_CODEGEN")  # the suite's own choice (conftest.py)
    assert mx.Plan().codegen == "auto"
    assert [mx.Plan().codegen_for(d) for d in ("cuda", "cpu", "mps")] == [
        "inductor", "inductor", "python"]
    monkeypatch.setattr("shutil.which", lambda name: None)  # no C++ compiler
    assert mx.Plan().codegen_for("cpu") == "python"
    assert mx.Plan(codegen="inductor").codegen_for("cpu") == "inductor"
    assert mx.Plan(codegen="python").codegen_for("cuda") == "python"
    assert mx.Plan.from_dict({"codegen": "auto"}).codegen_for("cuda") == "inductor"


def test_the_environment_chooses_what_auto_means(monkeypatch):
    monkeypatch.setenv("MXGRAPH_CODEGEN", "inductor")
    assert mx.Plan().codegen_for("cpu") == "inductor"
    assert mx.Plan(codegen="python").codegen_for("cpu") == "python"  # the plan's own word wins
    monkeypatch.setenv("MXGRAPH_CODEGEN", "triton")
    with pytest.raises(mx.PlanError, match="MXGRAPH_CODEGEN: 'triton' is unknown; choose from python, inductor"):
        mx.Plan().codegen_for("cpu")
    monkeypatch.setenv("MXGRAPH_CODEGEN", "")  # `MXGRAPH_CODEGEN= cmd` unsets the choice
    assert mx.Plan().codegen_for("mps") == "python"


def _tp2_sp_under_inductor(rank, world):
    from tests.runtime.test_pipeline_exec import check_plan
    check_plan(rank, world, "llama-tiny", dict(tp=2, sequence_parallel=True, codegen="inductor"),
               2, 4, 16, {"n_layers": 1})


@pytest.mark.slow
def test_collectives_are_lowered_by_inductor_in_place(monkeypatch):
    """tp2 + SP: every program with all-gathers, reduce-scatters and all-reduces and their
    waits is lowered (MXGRAPH_STRICT=1: none falls back) and matches eager (check_plan:
    loss, gradients, parameters after 2 AdamW steps)."""
    from tests.distributed import run_ranks
    monkeypatch.setenv("MXGRAPH_STRICT", "1")
    run_ranks(2, _tp2_sp_under_inductor)


def _callbacks_under_inductor(rank, world):
    from mxgraph.runtime.data_parallel.overlap import BucketOverlap
    from mxgraph.runtime.monitor.slow_node import MonitorConfig, StepMonitor
    first_use = []
    gathered = BucketOverlap.gathered

    def waited(self, param):  # a ZeRO-1 gather still in flight, completed where first read
        if self.bucket_of.get(id(param)) in self.gathers:
            first_use.append(id(param))
        gathered(self, param)
    BucketOverlap.gathered = waited
    losses = {}
    for codegen in ("python", "inductor"):
        torch.manual_seed(0)
        model = models.build_model("llama-tiny", n_layers=1)
        plan = mx.Plan(dp=2, zero1=True, bucket_mb=0.02, overlap=mx.OverlapOptions(),
                       codegen=codegen)
        tokens, targets = batch(batch_size=2, seq_len=16, seed=rank)
        step = mx.compile(model, plan)
        monitor = StepMonitor(config=MonitorConfig(level=1, report_every=100))
        step.set_monitor(monitor)  # level 1: before the compile, which writes the points
        step.prepare(tokens, targets)
        opt = torch.optim.AdamW(step.parameters(), lr=1e-2)
        first_use.clear()
        losses[codegen] = []
        for _ in range(2):
            losses[codegen].append(step(tokens, targets))
            opt.step()
            opt.zero_grad()
            monitor.step()
        overlaps = list(step.bucket_overlaps.values())
        assert overlaps and all(o.early for o in overlaps), "no bucket started in the backward"
        assert first_use, "no ZeRO-1 parameter was waited for at its first use"
        assert {"fwd:layer 0", "bwd:layer 0"} <= set(monitor.kinds), sorted(monitor.kinds)
    for python, inductor in zip(losses["python"], losses["inductor"], strict=True):
        assert rel_err(inductor, python) <= 1e-5, (inductor.item(), python.item())


@pytest.mark.slow
def test_executor_callbacks_fire_in_lowered_programs(monkeypatch):
    """dp2 + ZeRO-1 with overlap and a level-1 monitor, programs lowered in segments
    (MXGRAPH_STRICT=1: none falls back): buckets start inside the backward, ZeRO-1 gathers
    are waited for at first use, the layers' timing points record, as under Python codegen;
    losses of 2 AdamW steps within 1e-5 of Python codegen's."""
    from tests.distributed import run_ranks
    monkeypatch.setenv("MXGRAPH_STRICT", "1")
    run_ranks(2, _callbacks_under_inductor)


def test_a_size_no_input_binds_is_made_a_symbol_of_its_own():
    """A W program of expert parallelism reads tokens received from two ranks, (u0 + u1, d),
    and neither count: Inductor binds symbols only from a size that is one symbol, so the
    size becomes a fresh symbol (the same one on every input that has it) and the program
    lowers and computes what eager torch does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mxgraph.codegen.inductor import compile_graph

    def program(x, y):
        return (x * y).sum(0), x.t() @ y
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode, mode.shape_env.ignore_fresh_unbacked_symbols():  # as received counts are
        u0, u1 = mode.shape_env.create_unbacked_symint(), mode.shape_env.create_unbacked_symint()
        torch._check(u0 >= 0), torch._check(u1 >= 0)
        x, y = torch.empty(u0 + u1, 4), torch.empty(u0 + u1, 4)
    gm = make_fx(program)(x, y)
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), (x, y), strict=True):
        node.meta["val"] = value
    fn, _ = compile_graph(gm, [x, y])
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    for got, want in zip(fn(a, b), program(a, b), strict=True):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_outputs_keep_the_layout_later_programs_were_compiled_for():
    """A program's output is laid out as its recorded example, which later programs are
    compiled for (Inductor checks its inputs' strides), even where Inductor would write it
    otherwise: phi3's rotary `cat` of transposed halves came out transposed where ATen's
    `cat`, so the recorded value, is contiguous; W then stopped on the stride check."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mxgraph.codegen.inductor import compile_graph

    def program(x):
        t = x.transpose(1, 2)  # (2, 4, 8, 6) read transposed
        return torch.cat((-t[..., 3:], t[..., :3]), dim=-1) * 2.0, t.sin()
    x = torch.randn(2, 8, 4, 6)
    gm = make_fx(program)(x)
    out = gm.graph.find_nodes(op="output")[0].args[0]
    # recorded examples laid out otherwise than Inductor would write them: the cat
    # transposed, the sine (of a transposed value) contiguous
    out[0].meta["val"] = torch.empty(2, 8, 4, 6).transpose(1, 2)
    out[1].meta["val"] = torch.empty(2, 4, 8, 6)
    fn, _ = compile_graph(gm, [x])
    got = fn(x)
    for value, want, recorded in zip(got, program(x), (out[0], out[1]), strict=True):
        assert value.stride() == recorded.meta["val"].stride()
        assert torch.allclose(value, want, rtol=1e-6, atol=1e-6)


def test_a_program_without_donated_inputs_is_served_by_the_fx_graph_cache():
    """Inductor's FX graph cache needs a shape environment from a tracing context; a program
    that donates nothing (every F) had none and was compiled from scratch in every process
    (11 s of the 21 s hf-llama-20m took to compile). Compiled twice, the second compile is a
    cache hit and neither bypasses the cache."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mxgraph.codegen.inductor import compile_graph

    def program(x, w):
        return (torch.relu(x @ w) * 3.0).sum(-1), x.cos()
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x, w = torch.empty(6, 4), torch.empty(4, 5)
    gm = make_fx(program)(x, w)
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), (x, w), strict=True):
        node.meta["val"] = value
    bypassed = counters["inductor"]["fxgraph_cache_bypass"]
    compile_graph(gm, [x, w])
    hits = counters["inductor"]["fxgraph_cache_hit"]
    fn, _ = compile_graph(gm, [x, w])
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
    assert counters["inductor"]["fxgraph_cache_bypass"] == bypassed
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    for got, want in zip(fn(a, b), program(a, b), strict=True):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
