"""mxgraph/passes/causal_mask.py: an attention mask computed from shapes alone that is the
causal one becomes SDPA's is_causal=True. A Hugging Face Llama (library defaults, sizes
shrunk) traced by torch.export builds its causal mask; after the pass no SDPA reads a mask,
and the compiled step still gives the eager loss and gradients (fp32, 1e-5 and 1e-4 relative).
A hand-written float mask (0 and -inf) is rewritten too, with the eager loss and gradients
within 1e-6; a sliding-window mask and a mask read from an input stay as they are."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxgraph as mx
from mxgraph.context import CompileContext
from mxgraph.driver import compile_step
from mxgraph.runtime.cluster.mesh import Mesh
from tests.helpers import rel_err

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """One attention layer over an embedding whose mask is built in the forward by `mask`
    (s -> mask) or read from the input (`mask=None`)."""

    def __init__(self, mask=None):
        super().__init__()
        self.embed, self.qkv, self.out = nn.Embedding(64, 32), nn.Linear(32, 96), nn.Linear(32, 64)
        self.mask = mask

    def forward(self, tokens, targets, padding=None):
        b, s = tokens.shape
        q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 2, 16).permute(2, 0, 3, 1, 4)
        mask = self.mask(s) if self.mask is not None else padding[:, None, None, :].bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.out(y.transpose(1, 2).reshape(b, s, 32))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def additive_causal(s):
    return torch.full((s, s), float("-inf")).triu(1)


def window(s):
    i = torch.arange(s)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)


def _attention_calls(model, *args):
    plan = mx.Plan()
    ctx = CompileContext(plan=plan, mesh=Mesh.on_paper())
    compilation = compile_step(model, plan, Mesh.on_paper(), ctx, args, {},
                               stop_after="causal_mask")
    gm = compilation.forward.gm
    return [(node.kwargs.get("is_causal", False), len(node.args) > 3 or "attn_mask" in node.kwargs)
            for node in gm.graph.find_nodes(op="call_function", target=SDPA)]


def _batch(b=2, s=12):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)


def test_an_additive_causal_mask_becomes_is_causal_and_matches_eager():
    torch.manual_seed(0)
    model = Attention(additive_causal)
    tokens, targets = _batch()
    assert _attention_calls(model, tokens, targets) == [(True, False)]
    reference = Attention(additive_causal)
    reference.load_state_dict(model.state_dict())
    loss = mx.compile(model)(tokens, targets)
    want = reference(tokens, targets)
    want.backward()
    assert rel_err(loss, want.detach()) <= 1e-6
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-6, name


@pytest.mark.parametrize("mask", [window, None], ids=["sliding window", "from the input"])
def test_other_masks_stay(mask):
    model = Attention(mask)
    tokens, targets = _batch()
    padding = torch.ones(2, 12)
    padding[0, :3] = 0
    args = (tokens, targets) if mask else (tokens, targets, padding)
    assert _attention_calls(model, *args) == [(False, True)]


def test_a_hugging_face_llama_attends_causally_without_a_mask():
    pytest.importorskip("transformers")
    from mxgraph.hf.models import TINY, build_hf_model
    torch.manual_seed(0)
    model = build_hf_model("hf:llama", TINY["llama"])
    tokens, targets = (t.remainder(256) for t in _batch(s=16))
    calls = _attention_calls(model, tokens, targets)
    assert calls and all(c == (True, False) for c in calls), calls
    eager = model(tokens, targets)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = mx.compile(model)(tokens, targets)
    assert rel_err(loss, eager.detach()) <= 1e-5
    for name, p in model.named_parameters():
        assert rel_err(p.grad, grads[name]) <= 1e-4, name
