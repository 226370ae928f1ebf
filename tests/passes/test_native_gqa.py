"""mxgraph/passes/native_gqa.py: K/V heads repeated for grouped-query attention become SDPA's
own `enable_gqa=True` under Inductor codegen. A Hugging Face Llama (library defaults, sizes
shrunk; its `repeat_kv` traced by torch.export) and the llama preset (its own expand +
reshape before a transpose) lose their repeats; the compiled Hugging Face step gives eager's
loss and gradients (fp32: 1e-5 and 1e-4 relative, Inductor's bounds; eager calls SDPA with
shared heads itself). Python codegen keeps the repeat (op for op the model's own), and off
the CPU only fp16/bf16 calls with a head dim of at most 256 are rewritten."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import models
import mxgraph as mx
from mxgraph.context import CompileContext
from mxgraph.driver import compile_step
from mxgraph.passes.native_gqa import sdpa_takes_gqa
from mxgraph.runtime.cluster.mesh import Mesh
from tests.helpers import rel_err

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _batch(b=2, s=16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (b, s), generator=g), torch.randint(0, 256, (b, s), generator=g)


def _attention_calls(model, codegen):
    """(enable_gqa, K heads, V heads, repeats left) of each SDPA after the pass."""
    plan = mx.Plan(codegen=codegen)
    ctx = CompileContext(plan=plan, mesh=Mesh.on_paper())
    gm = compile_step(model, plan, Mesh.on_paper(), ctx, _batch(), {},
                      stop_after="native_gqa").forward.gm
    expands = len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.expand.default))
    return [(n.kwargs.get("enable_gqa", False), n.args[1].meta["val"].shape[1],
             n.args[2].meta["val"].shape[1], expands)
            for n in gm.graph.find_nodes(op="call_function", target=SDPA)]


def _hf_llama():
    pytest.importorskip("transformers")
    from mxgraph.hf.models import TINY, build_hf_model
    torch.manual_seed(0)
    return build_hf_model("hf:llama", TINY["llama"])


@pytest.mark.parametrize("build", [_hf_llama, lambda: models.build_model("llama-tiny")],
                         ids=["hugging face llama", "llama preset"])
def test_repeated_kv_heads_become_sdpa_gqa_under_inductor(build):
    model = build()
    heads = (2, 2)  # both tiny configs: 4 query heads over 2 K/V heads
    calls = _attention_calls(model, "inductor")
    assert calls and all(c[:3] == (True, *heads) for c in calls), calls
    assert calls[0][3] == 0, "the repeats' expands are gone"
    kept = _attention_calls(model, "python")
    assert kept and all(c[0] is False and c[1:3] == (4, 4) for c in kept), kept


def test_hugging_face_llama_step_matches_eager_under_inductor():
    model = _hf_llama()
    tokens, targets = _batch()
    eager = model(tokens, targets)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = mx.compile(model, mx.Plan(codegen="inductor"))(tokens, targets)
    assert rel_err(loss, eager.detach()) <= 1e-5
    for name, p in model.named_parameters():
        assert rel_err(p.grad, grads[name]) <= 1e-4, name


def test_off_the_cpu_only_flash_dtypes_take_shared_heads():
    with FakeTensorMode():
        def qkv(device, dtype, d=64):
            return (torch.empty(2, 8, 16, d, device=device, dtype=dtype),
                    *(torch.empty(2, 2, 16, d, device=device, dtype=dtype) for _ in range(2)))
        assert sdpa_takes_gqa(*qkv("cpu", torch.float32))
        assert sdpa_takes_gqa(*qkv("cuda", torch.bfloat16))
        assert sdpa_takes_gqa(*qkv("cuda", torch.float16))
        assert not sdpa_takes_gqa(*qkv("cuda", torch.float32))
        assert not sdpa_takes_gqa(*qkv("cuda", torch.bfloat16, d=512))
