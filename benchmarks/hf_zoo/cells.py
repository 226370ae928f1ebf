"""One cell of the zoo: a model type's eager check, or its training steps under one plan
compared with eager autograd.

A model is `shrink(CONFIG_MAPPING[t]())` built by `AutoModelForCausalLM.from_config` under
`torch.manual_seed(0)` in fp32, wrapped in `CausalLMLoss` (forward(input_ids, targets) ->
mean next-token cross-entropy of `.logits.float()`; the HF model is called with
`input_ids` alone, so `use_cache` and every other default stay as transformers has them).

A plan's cell runs STEPS SGD steps (the optimizer on `step.parameters()` right after
`mx.compile`, as the README does) on random tokens and compares, with a deep copy of the
model taken before the compile as the eager reference (accumulated over the same
data-parallel and micro-batch chunks, as tests/runtime/test_pipeline_exec.py's `check_plan`; both
start each step from the same RNG seed, `RNG_SEED`):
the loss of every step (relative error <= LOSS_TOL), the gradients of step 1 (except under
ZeRO-1, whose gradients live in flat shards) and the parameters after the last step (each
within GRAD_TOL of the reference's norm, floored at 1e-3 of the largest norm: this rank's
part of each reference tensor cut by `step.layouts`), the suite's own measures and
tolerances (tests/runtime/test_pipeline_exec.py).

A `mxmaca` cell records the backend's fallback warnings (`fallbacks`: regions run without
mxgraph's passes, loudly). Outcomes: pass; refused (mxgraph's PlanError or another
UserError: the plan or model is not supported, with the message); crash (any other exception: its type, first message line,
innermost mxgraph frame); wrong (runs, differs: the largest errors); timeout (the cell's
time limit, a SIGALRM in the process that runs it).
"""
from __future__ import annotations

import copy
import inspect
import math
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import mxgraph as mx
from mxgraph.errors import UserError
from tests.helpers import rel_err
from tests.runtime.test_pipeline_exec import GRAD_TOL, LOSS_TOL, floored_err, largest_norm, local

from .shrink import EXPERTS, VOCAB, shrink

BATCH, SEQ, STEPS, LR = 2, 16, 3, 1e-2
"""Per data-parallel rank: 2 sequences of 16 tokens; 3 SGD steps at lr 1e-2."""
RNG_SEED = 1000
"""Step i of both the plan and the eager reference starts from `torch.manual_seed(RNG_SEED + i)`:
a model that draws random numbers in training (PhiMoE's Gumbel routing) draws the same ones
where the plan runs its random ops in eager's order (one device, one micro-batch)."""
CAUSAL_ATOL = 1e-5
"""Largest change of a logit before the last token when only the last token changes."""


@dataclass(frozen=True, kw_only=True)
class PlanCase:
    """A column of the table."""

    world: int
    """Ranks (gloo processes; 1 = this process)."""
    plan: dict = field(default_factory=dict)
    """mx.Plan keyword arguments."""
    backend: bool = False
    """torch.compile(model, backend="mxmaca") instead of mx.compile."""
    moe_only: bool = False
    """Only for models with routed experts."""


PLANS = {
    "one": PlanCase(world=1),
    "fusion": PlanCase(world=1, plan=dict(fusion=True)),
    "mxmaca": PlanCase(world=1, backend=True),
    "tp2sp": PlanCase(world=2, plan=dict(tp=2, sequence_parallel=True)),
    "ep2": PlanCase(world=2, plan=dict(ep=2), moe_only=True),
    "cp2": PlanCase(world=2, plan=dict(cp=2)),
    "pp2": PlanCase(world=2, plan=dict(pp=2, schedule="1f1b", micro_batches=2)),
    "dp2z1": PlanCase(world=2, plan=dict(dp=2, zero1=True)),
    "tp2ep2": PlanCase(world=4, plan=dict(tp=2, ep=2), moe_only=True),
}
"""one: mx.Plan(); fusion: Plan(fusion=True); mxmaca: the torch.compile backend;
tp2sp: tp=2 + sequence parallelism; ep2: ep=2 (dp=2; MoE models only); cp2: cp=2;
pp2: pp=2, 1F1B, 2 micro-batches; dp2z1: dp=2 with ZeRO-1; tp2ep2: tp=2 x ep=2 on 4 ranks
(MoE models only)."""


class CausalLMLoss(nn.Module):
    """`forward(input_ids, targets) -> loss`: mean cross-entropy of the HF model's fp32 logits
    against `targets` (already shifted), the HF model called with `input_ids` only."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


class CellTimeout(Exception):
    """The cell ran past its time limit."""


def build(model_type: str) -> CausalLMLoss:
    """The shrunk model under torch.manual_seed(0), fp32, in training mode."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    config = shrink(CONFIG_MAPPING[model_type]())
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return CausalLMLoss(hf_model).train()


def batches(global_batch: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
             torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)) for _ in range(steps)]


def is_moe(config) -> bool:
    """Whether the config (or a sub-config) has routed experts."""
    from .shrink import ROLE
    values = config.to_dict()
    if any(ROLE.get(k) == "experts" and isinstance(v, int) and 1 < v <= EXPERTS for k, v in values.items()):
        return True
    return any(is_moe(getattr(config, k)) for k in config.sub_configs if hasattr(getattr(config, k, None), "to_dict"))


def skip_reason(model_type: str) -> str | None:
    """Why a mapped model type is no decoder-only causal LM taking text alone, or None."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    config = CONFIG_MAPPING[model_type]()
    if config.is_encoder_decoder:
        return "encoder-decoder (is_encoder_decoder=True): its causal LM class is the decoder half"
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    needs = [p.name for p in list(inspect.signature(model_class.forward).parameters.values())[1:]
             if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             and p.name != "input_ids"]
    return f"{model_class.__name__}.forward needs {', '.join(needs)}" if needs else None


def eager_cell(model_type: str) -> dict:
    """Build, forward + backward on one batch, and the causality check; "pass" with the
    model's facts, "skipped" (not a decoder-only causal LM) or "eager fails"."""
    start = time.perf_counter()
    try:
        reason = skip_reason(model_type)
        if reason:
            return {"status": "skipped", "detail": reason}
        model = build(model_type)
        tokens, targets = batches(BATCH, 1)[0]
        loss = model(tokens, targets)
        loss.backward()
        if not math.isfinite(loss.item()):
            return {"status": "eager fails", "detail": f"loss is {loss.item()}"}
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
        if bad:
            return {"status": "eager fails", "detail": f"non-finite gradient of {bad[0]}"}
        change = _future_dependence(model, tokens)
        if change > CAUSAL_ATOL:
            return {"status": "skipped", "detail": "not causal: logits before the last token change with it",
                    "future_change": change}
        return {"status": "pass", "moe": is_moe(model.model.config), "loss": loss.item(),
                "params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - start}
    except Exception as error:  # noqa: BLE001 - recorded
        return {"status": "eager fails", **_describe(error, mxgraph_frame=False)}


def _future_dependence(model: CausalLMLoss, tokens: torch.Tensor) -> float:
    """Largest change of the logits before the last position when the last token changes
    (eval mode: no router jitter)."""
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    model.eval()
    try:
        with torch.no_grad():
            a, b = (model.model(input_ids=t).logits[:, :-1].float() for t in (tokens, changed))
    finally:
        model.train()
    return (a - b).abs().max().item()


def run_cell(model_type: str, case: PlanCase, rank: int = 0, world: int = 1, timeout: float = 300) -> dict:
    """One plan's cell on this rank (world ranks of a process group when world > 1)."""
    from mxgraph.backend import BackendFallbackWarning
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", BackendFallbackWarning)
        try:
            result = _compare(model_type, case, rank, world)
        except CellTimeout:
            result = {"status": "timeout", "detail": f"over {timeout:.0f} s"}
        except UserError as error:
            result = {"status": "refused", **_describe(error)}
        except Exception as error:  # noqa: BLE001 - recorded
            result = {"status": "crash", **_describe(error)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    fallbacks = sorted({str(w.message).split("(no sharding, no fusion): ", 1)[-1] for w in seen
                        if issubclass(w.category, BackendFallbackWarning)})
    return {**result, **({"fallbacks": fallbacks} if fallbacks else {}),
            "seconds": round(time.perf_counter() - start, 1)}


def _on_alarm(signum, frame):
    raise CellTimeout


def draws_random(model: nn.Module) -> bool:
    """Whether the model's training forward draws random numbers (PhiMoE's Gumbel routing,
    a LayerDrop that is on): a random op, not counting one whose dropout probability is 0 (the CPU
    flash attention and dropout are random ops by tag, and draw nothing at p = 0)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        seen = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.seen |= torch.Tag.nondeterministic_seeded in func.tags and \
                not _dropout_off(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    tokens, targets = batches(BATCH, 1)[0]
    with torch.no_grad(), Count():
        model(tokens, targets)
    return Count.seen


def _dropout_off(func, args, kwargs) -> bool:
    """Whether `func`'s dropout probability (`p`, `dropout_p`) is 0."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name in ("p", "dropout_p"):
            value = args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value)
            return value == 0
    return False


def _compare(model_type: str, case: PlanCase, rank: int, world: int) -> dict:
    """Run the steps and measure the largest errors against eager (module docstring).

    A model that draws random numbers in training, under a plan that splits the batch
    (ranks or micro-batches draw in another order than one eager batch): the training steps
    must run and stay finite, and the comparison is made in eval mode."""
    plan = mx.Plan(**case.plan)
    if (world > 1 or plan.micro_batches > 1) and draws_random(build(model_type)):
        losses = _train(model_type, case, rank, world)
        if not all(math.isfinite(x) for x in losses):
            return {"status": "wrong", "detail": f"training losses {losses}"}
        result = _compare_in(model_type, case, rank, world, train=False)
        note = "draws random numbers in training: 3 finite training steps, compared in eval mode"
        return {**result, "detail": "; ".join(filter(None, [result["detail"], note]))}
    return _compare_in(model_type, case, rank, world, train=True)


def _train(model_type: str, case: PlanCase, rank: int, world: int) -> list[float]:
    """The plan's training losses of STEPS steps (this rank's)."""
    model, (plan, _, mine, data) = build(model_type), _setup(case, rank, world)
    step = mx.compile(model, plan, example=(data[0][0][mine], data[0][1][mine]))
    opt = torch.optim.SGD(step.parameters(), lr=LR)
    losses = []
    for tokens, targets in data:
        losses.append(step(tokens[mine], targets[mine]).item())
        opt.step(); opt.zero_grad()
    return losses


def _setup(case: PlanCase, rank: int, world: int) -> tuple[mx.Plan, int, slice, list]:
    """The plan, its data-parallel size, this rank's rows of a global batch, the batches."""
    plan = mx.Plan(**case.plan)
    dp = plan.resolve_dp(world)
    dp_rank = (rank // (plan.tp * plan.cp)) % dp  # the mesh's order: pp, dp, cp, tp
    return plan, dp, slice(dp_rank * BATCH, (dp_rank + 1) * BATCH), batches(BATCH * dp)


def _compare_in(model_type: str, case: PlanCase, rank: int, world: int, train: bool) -> dict:
    model = build(model_type).train(train)
    reference = copy.deepcopy(model)
    plan, dp, mine, data = _setup(case, rank, world)
    if case.backend:
        torch._dynamo.reset()
        step, params = torch.compile(model, backend="mxmaca"), list(model.parameters())
    else:
        step = mx.compile(model, plan, example=(data[0][0][mine], data[0][1][mine]))
        params = list(step.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    chunks = dp * plan.micro_batches
    errors = {"loss": (0.0, ""), "grad": (0.0, ""), "param": (0.0, "")}
    for i, (tokens, targets) in enumerate(data):
        torch.manual_seed(RNG_SEED + i)  # random ops (router sampling) draw alike in both
        loss = step(tokens[mine], targets[mine])
        if case.backend:
            loss.backward()
        torch.manual_seed(RNG_SEED + i)
        ref_loss = sum(reference(x, y) / chunks for x, y in
                       zip(tokens.chunk(chunks), targets.chunk(chunks), strict=True))
        ref_loss.backward()
        _worst(errors, "loss", rel_err(loss.detach(), ref_loss.detach()), f"step {i + 1}")
        if i == 0 and not plan.zero1:
            for name, err in _grad_errors(model if case.backend else step, reference, case.backend):
                _worst(errors, "grad", err, name)
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    if case.backend:
        named = list(model.named_parameters())
    else:
        step.sync_parameters()  # zero1: the last update is in the shards
        named = step.model_parameters()
    ref_params = dict(reference.named_parameters())
    scale = largest_norm(reference)
    for name, param in named:
        full = ref_params[name].detach()
        part = full if case.backend else local(full, param, step, param)
        _worst(errors, "param", floored_err(param.detach(), part, scale), name)
    tol = {"loss": LOSS_TOL, "grad": GRAD_TOL, "param": GRAD_TOL}
    over = [f"{k} {v:.1e} ({where})" for k, (v, where) in errors.items() if not v <= tol[k]]
    return {"status": "wrong" if over else "pass", "detail": "; ".join(over),
            "max_err": {k: v for k, (v, _) in errors.items()}}


def _grad_errors(step, reference: nn.Module, plain: bool):
    """(name, floored error) of the gradient of every parameter this rank trains; inf where
    the step left none and eager has a non-zero one."""
    ref_params = dict(reference.named_parameters())
    scale = largest_norm(reference, "grad")
    for name, param in step.named_parameters():
        ref = ref_params[name].grad
        if not param.requires_grad or (param.grad is None and (ref is None or not ref.any())):
            continue
        if param.grad is None:
            yield name, math.inf
            continue
        full = torch.zeros_like(ref_params[name]) if ref is None else ref
        yield name, floored_err(param.grad, full if plain else local(full, param.grad, step, param), scale)


def _worst(errors: dict, kind: str, value: float, where: str) -> None:
    if not value <= errors[kind][0]:  # NaN counts as worst
        errors[kind] = (value, where)


def _describe(error: BaseException, mxgraph_frame: bool = True) -> dict:
    """The exception's type and first message line (and its innermost cause's, when it was
    raised from another: torch.compile's BackendCompilerFailed), where the innermost one was
    raised and, for mxgraph, the innermost mxgraph frame over the chain."""
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    inner = chain[-1]
    detail = _first_line(error)
    if inner is not error and _first_line(inner) not in detail:
        detail += f" <- {_first_line(inner)}"
    out = {"detail": detail}
    for exc in reversed(chain):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            out["raised_at"] = _short(frames[-1])
            break
    if mxgraph_frame:
        for exc in reversed(chain):
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/mxgraph/" in f.filename]
            if frames:
                out["mxgraph_at"] = _short(frames[-1])
                break
    return out


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # "backend='mxmaca' raised:" says nothing yet
        text += " " + lines[1].strip()
    return f"{type(error).__name__}: {text[:300]}"


def _short(frame) -> str:
    path = frame.filename
    for marker in ("/mxgraph/", "/site-packages/", "/benchmarks/"):
        if marker in path:
            path = path[path.rindex(marker) + 1:]
            break
    return f"{path}:{frame.lineno}"
