"""Each written form of each fusion pattern, as a small module: it is matched (fused-op count
in the compiled forward graph, read from the `fuse` pass's dump) and gives eager's loss and
gradients within 1e-6 (fp32)."""
from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxgraph as mx
from tests.helpers import rel_err

TOL = 1e-6


# ---- helpers (also used by test_fuse.py) ----------------------------------------------------
def dump_counts(dump_dir) -> Counter:
    """Fused forward ops per kind in the graph after the `fuse` pass of a compile dump."""
    entry = next(p for p in sorted(Path(dump_dir).iterdir()) if p.name.endswith("_fuse"))
    counts: Counter = Counter()
    lines = (entry / "nodes.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    op_col, tag_col = header.index("op"), header.index("tags")
    for line in lines[1:]:
        cols = line.split("\t")
        if not cols[op_col].startswith("mxgraph."):
            continue
        for tag in cols[tag_col].split(","):
            if tag.startswith("fused:"):
                counts[tag.removeprefix("fused:")] += 1
    return counts


def compile_and_compare(module: torch.nn.Module, args, fusion, dump_dir, tol: float = TOL):
    """Compile `module` with `fusion`, run one step and compare loss and grads with eager.

    Returns the fused-op counts of the compiled forward graph.
    """
    reference = copy.deepcopy(module)
    step = mx.compile(module, mx.Plan(fusion=fusion, dump_dir=str(dump_dir)))
    loss = step(*args)
    ref_loss = reference(*args)
    ref_loss.backward()
    assert rel_err(loss, ref_loss.detach()) <= tol, (loss.item(), ref_loss.item())
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters(), strict=True):
        assert p.grad is not None, f"{name}: no gradient"
        err = rel_err(p.grad, q.grad)
        assert err <= tol, f"{name}: gradient relative error {err:.2e}"
    return dump_counts(dump_dir)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Loss(nn.Module):
    """Base: forward(x) -> mean square of `body(x)` (a scalar loss to differentiate)."""

    def forward(self, x):
        return self.body(x).float().pow(2).mean()


# ---- SwiGLU ------------------------------------------------------------------------------
ACT2FN = {"silu": nn.SiLU, "gelu": nn.GELU}  # the HF-style registry: name -> activation


class SwiGLUFunctional(Loss):
    def __init__(self, act="functional", bias=False):
        super().__init__()
        self.gate, self.up = nn.Linear(8, 16, bias=bias), nn.Linear(8, 16, bias=bias)
        self.act = {"module": nn.SiLU(), "registry": ACT2FN["silu"]()}.get(act, F.silu)

    def body(self, x):
        return self.act(self.gate(x)) * self.up(x)


class SwiGLUSigmoid(Loss):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)

    def body(self, x):
        a = self.gate(x)
        return a * torch.sigmoid(a) * self.up(x)


class SwiGLUPacked(Loss):
    """One biased linear feeds both halves."""

    def __init__(self):
        super().__init__()
        self.w12 = nn.Linear(8, 32)
        nn.init.normal_(self.w12.bias)

    def body(self, x):
        a, b = self.w12(x).chunk(2, dim=-1)
        return F.silu(a) * b


@pytest.mark.parametrize("make, kind", [
    (lambda: SwiGLUFunctional(), "swiglu"),
    (lambda: SwiGLUFunctional("module"), "swiglu"),
    (lambda: SwiGLUFunctional("registry"), "swiglu"),
    (SwiGLUSigmoid, "swiglu"),
    (lambda: SwiGLUFunctional(bias=True), "swiglu"),
    (SwiGLUPacked, "swiglu"),
], ids=["silu", "nn.SiLU", "ACT2FN", "x*sigmoid(x)", "two-biased-linears", "packed-biased-linear"])
def test_swiglu_forms(make, kind, tmp_path):
    torch.manual_seed(0)
    assert compile_and_compare(make(), (_x(2, 4, 8),), "swiglu", tmp_path) == {"swiglu": 1}


def test_bias_swiglu_moves_the_bias(tmp_path):
    torch.manual_seed(0)
    compile_and_compare(SwiGLUPacked(), (_x(2, 4, 8),), "swiglu", tmp_path)
    code = next(tmp_path.glob("*_fuse")).joinpath("code.py").read_text()
    assert "mxgraph.bias_swiglu" in code


# ---- bias-GELU ---------------------------------------------------------------------------
class BiasGelu(Loss):
    def __init__(self, form, approximate="none"):
        super().__init__()
        self.form, self.approximate = form, approximate
        self.fc = nn.Linear(8, 16)
        nn.init.normal_(self.fc.bias)

    def body(self, x):
        if self.form == "add":
            return F.gelu(F.linear(x, self.fc.weight) + self.fc.bias, approximate=self.approximate)
        return F.gelu(F.linear(x, self.fc.weight, self.fc.bias), approximate=self.approximate)


@pytest.mark.parametrize("form, approximate", [("add", "none"), ("linear", "none"), ("add", "tanh"),
                                               ("linear", "tanh")])
def test_bias_gelu_forms(form, approximate, tmp_path):
    torch.manual_seed(0)
    counts = compile_and_compare(BiasGelu(form, approximate), (_x(2, 4, 8),), "bias_gelu", tmp_path)
    assert counts == {"bias_gelu": 1}


# ---- bias-dropout-add --------------------------------------------------------------------
class BDA(Loss):
    def __init__(self, p=0.0, form="inline"):
        super().__init__()
        self.p, self.form = p, form
        self.proj = nn.Linear(8, 8, bias=form == "linear")
        if form == "inline":
            self.bias = nn.Parameter(torch.randn(8))

    def body(self, x):
        if self.form == "linear":  # HF style: residual + dropout(dense(x)), the bias inside dense
            return x + F.dropout(self.proj(x), self.p, self.training)
        return x + F.dropout(self.proj(x) + self.bias, self.p, self.training)


def test_bda_dropout_off_matches_eager(tmp_path):
    torch.manual_seed(0)
    model = BDA(p=0.1).eval()   # dropout off: F.dropout is the identity
    assert compile_and_compare(model, (_x(2, 4, 8),), "bias_dropout_add", tmp_path) == {
        "bias_dropout_add": 1}


@pytest.mark.parametrize("form", ["inline", "linear"])
def test_bda_dropout_on_same_seed_same_loss(form, tmp_path):
    losses = []
    for run in range(2):
        torch.manual_seed(0)
        model = BDA(p=0.5, form=form)
        step = mx.compile(model, mx.Plan(fusion="bias_dropout_add", dump_dir=str(tmp_path / str(run))))
        torch.manual_seed(123)
        losses.append([step(_x(2, 4, 8)).item() for _ in range(2)])
        assert dump_counts(tmp_path / str(run)) == {"bias_dropout_add": 1}
    assert losses[0] == losses[1]
    assert losses[0][0] != losses[0][1]  # a new mask every step


# ---- RoPE --------------------------------------------------------------------------------
def _tables(seq, dim, interleaved=False):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.outer(torch.arange(seq).float(), inv)
    ang = ang.repeat_interleave(2, -1) if interleaved else torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rotate_half_cat(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_stack(x):
    h = x.shape[-1] // 2
    return torch.stack((-x[..., h:], x[..., :h]), dim=-2).flatten(-2)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class RoPEAttention(nn.Module):
    """q, k rotated then a plain attention score; layout BSHD (Llama) or BHSD (HF)."""

    def __init__(self, form="cat", layout="bshd", rot=8):
        super().__init__()
        self.form, self.layout, self.rot = form, layout, rot
        self.wq, self.wk = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
        cos, sin = _tables(16, rot, interleaved=form == "interleaved")
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        if form == "complex":
            self.register_buffer("freqs", torch.polar(torch.ones_like(cos[:, ::2]), cos.acos()[:, ::2]))

    def rope(self, x, cos, sin):
        rotate = {"cat": rotate_half_cat, "stack": rotate_half_stack,
                  "interleaved": rotate_every_two}[self.form]
        if self.rot < x.shape[-1]:
            x_rot, x_pass = x[..., :self.rot], x[..., self.rot:]
            return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)
        x32 = x.float()
        return (x32 * cos + rotate(x32) * sin).type_as(x)

    def complex_rope(self, x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    def forward(self, x):
        B, S, _ = x.shape
        q, k = self.wq(x).view(B, S, 2, 8), self.wk(x).view(B, S, 2, 8)
        if self.form == "complex":
            freqs = self.freqs[:S].view(1, S, 1, -1)
            q, k = self.complex_rope(q, freqs), self.complex_rope(k, freqs)
        elif self.layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            cos, sin = self.cos[:S].unsqueeze(0).unsqueeze(1), self.sin[:S].unsqueeze(0).unsqueeze(1)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            cos, sin = self.cos[:S][None, :, None], self.sin[:S][None, :, None]
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        return torch.einsum("bshd,bthd->bhst", q, k).pow(2).mean()


@pytest.mark.parametrize("form, layout, rot", [
    ("cat", "bshd", 8), ("cat", "bhsd", 8), ("stack", "bshd", 8), ("interleaved", "bshd", 8),
    ("complex", "bshd", 8), ("cat", "bhsd", 4)],
    ids=["cat", "cat-bhsd", "stack", "interleaved", "complex", "partial"])
def test_rope_forms(form, layout, rot, tmp_path):
    torch.manual_seed(0)
    counts = compile_and_compare(RoPEAttention(form, layout, rot), (_x(2, 6, 8),), "rope", tmp_path)
    assert counts == {"rope": 1}  # q and k share one op


# ---- Repeat-GQA --------------------------------------------------------------------------
class GQA(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        # no key bias: its gradient is 0 in exact arithmetic (softmax ignores a per-row shift)
        self.wq, self.wk, self.wv = nn.Linear(8, 32), nn.Linear(8, 16, bias=False), nn.Linear(8, 16)

    def repeat(self, x, rep):  # x: [B, K, S, D]
        if self.form == "enable_gqa":
            return x
        if self.form == "repeat_interleave":
            return x.repeat_interleave(rep, dim=1)
        B, K, S, D = x.shape
        return x[:, :, None].expand(B, K, rep, S, D).reshape(B, K * rep, S, D)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, 4, 8).transpose(1, 2)
        k = self.wk(x).view(B, S, 2, 8).transpose(1, 2)
        v = self.wv(x).view(B, S, 2, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, self.repeat(k, 2), self.repeat(v, 2), is_causal=True,
                                             enable_gqa=self.form == "enable_gqa")
        return out.pow(2).mean()


@pytest.mark.parametrize("form", ["repeat_interleave", "expand", "enable_gqa"])
def test_gqa_forms(form, tmp_path):
    torch.manual_seed(0)
    assert compile_and_compare(GQA(form), (_x(2, 6, 8),), "gqa", tmp_path) == {"gqa": 1}


# ---- RMSNorm -----------------------------------------------------------------------------
class Norm(Loss):
    def __init__(self, form, residual=False):
        super().__init__()
        self.form, self.residual = form, residual
        self.proj = nn.Linear(8, 8, bias=False)
        if form == "aten":
            self.rms = nn.RMSNorm(8, eps=1e-6)
            nn.init.uniform_(self.rms.weight, 0.5, 1.5)
        else:
            self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def body(self, x):
        h = x + self.proj(x) if self.residual else self.proj(x)
        if self.form == "aten":
            y = self.rms(h)
        elif self.form == "hf":  # LlamaRMSNorm of transformers: weight on the left, .to(dtype)
            h32 = h.to(torch.float32)
            variance = h32.pow(2).mean(-1, keepdim=True)
            y = self.weight * (h32 * torch.rsqrt(variance + 1e-6)).to(h.dtype)
        else:
            h32 = h.float()
            y = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(h) * self.weight
        return y + h if self.residual else y


@pytest.mark.parametrize("form, residual", [("aten", False), ("manual", False), ("manual", True),
                                            ("aten", True), ("hf", False)])
def test_rmsnorm_forms(form, residual, tmp_path):
    torch.manual_seed(0)
    model = Norm(form, residual)
    counts = compile_and_compare(model, (_x(2, 4, 8),), "rmsnorm", tmp_path)
    assert counts == {"rmsnorm": 1}
    code = next(tmp_path.glob("*_fuse")).joinpath("code.py").read_text()
    assert ("mxgraph.add_rmsnorm" in code) == residual


# ---- linear + cross-entropy --------------------------------------------------------------
class LMHead(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, h, targets):
        logits = F.linear(h, self.head.weight)
        if self.form == "view":
            return F.cross_entropy(logits.view(-1, 32).float(), targets.view(-1))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("form", ["view", "flatten"])
def test_linear_cross_entropy_forms(form, tmp_path):
    torch.manual_seed(0)
    targets = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    targets[0, 0] = -100  # ignored
    counts = compile_and_compare(LMHead(form), (_x(2, 6, 8), targets), "linear_cross_entropy", tmp_path)
    assert counts == {"linear_cross_entropy": 1}


# ---- MoE router and permute/unpermute ----------------------------------------------------
class Router(nn.Module):
    """Gate weights and expert ids; the loss reads both (ids through a per-expert table)."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.5)
        self.table = nn.Parameter(torch.randn(8, 4))
        self.register_buffer("expert_bias", torch.randn(8) * 0.1)

    def route(self, x):
        logits = F.linear(x, self.weight).float()
        if self.form == "hf":  # Mixtral-style: softmax, top-k values, renormalise
            probs = F.softmax(logits, dim=1, dtype=torch.float)
            weights, ids = torch.topk(probs, 2, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        scores = logits.sigmoid()
        choice = scores + self.expert_bias
        if self.form == "grouped":  # DeepSeek-V3-style: 4 groups, best 2 per group, keep 2 groups
            grouped = choice.view(x.shape[0], 4, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(2, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, keep, True)
            choice = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(4, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * 2.5, ids

    def forward(self, x):
        weights, ids = self.route(x)
        return (weights[..., None] * self.table[ids]).sum() + weights.pow(2).sum()


@pytest.mark.parametrize("form", ["hf", "biased", "grouped"])
def test_moe_router_forms(form, tmp_path):
    torch.manual_seed(0)
    assert compile_and_compare(Router(form), (_x(12, 16),), "moe_router", tmp_path) == {"moe_router": 1}


class Dispatch(nn.Module):
    """Dropless dispatch written out: sort assignments by expert, run, weight, scatter back."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.probs = nn.Parameter(torch.rand(6, 2))

    def forward(self, x, ids):
        T, K = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // K
        counts = torch.zeros(4, dtype=torch.long).scatter_add(0, flat, torch.ones_like(flat))
        y_rows = torch.tanh(self.up(x[token]))
        w_rows = self.probs.reshape(-1)[order]
        out = torch.zeros_like(x).index_add(0, token, y_rows * w_rows[:, None])
        return out.pow(2).mean() + counts.max().float() * 0.0


def test_moe_permute_form(tmp_path):
    torch.manual_seed(0)
    ids = torch.tensor([[0, 3], [1, 3], [3, 2], [0, 1], [2, 0], [1, 2]])
    counts = compile_and_compare(Dispatch(), (_x(6, 8), ids), "moe_permute", tmp_path)
    assert counts == {"moe_permute": 2}  # permute and unpermute


@pytest.mark.parametrize("form", ["inline", "linear"])
def test_bda_dropout_on_keeping_everything_matches_eager(form, tmp_path):
    """p = 1e-9: a training dropout that (almost surely) keeps every element with scale 1.0 in
    fp32, so the fused path with its own mask must equal eager."""
    torch.manual_seed(0)
    counts = compile_and_compare(BDA(p=1e-9, form=form), (_x(2, 4, 8),), "bias_dropout_add", tmp_path)
    assert counts == {"bias_dropout_add": 1}
