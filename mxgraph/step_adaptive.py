"""`AdaptiveMoEStep`: MoE adaptive recompute, a step that runs one of two compiled variants.

See `runtime/adaptive.py` for the rule: before each step the router's token counts per EP
rank pick the fast variant (the plan's recompute policy without MoE kinds) or the
recompute one (with them). Both variants are `Step`s of the same model on one mesh, so the
parameters, the gradients they fill and the mesh are shared; it implements `TrainingStep`.
"""
from __future__ import annotations

import torch

from mxgraph.errors import PlanError
from mxgraph.plan import Plan
from mxgraph.runtime.adaptive import count_tokens_per_rank, log, variant_plans
from mxgraph.runtime.cluster.mesh import Mesh
from mxgraph.step import Step


class AdaptiveMoEStep:
    """A compiled step that switches MoE layers to recompute on heavy routing steps."""

    def __init__(self, model: torch.nn.Module, plan: Plan, ep: int | None = None,
                 mesh: Mesh | None = None):
        if plan.precision == "bf16-mixed":
            raise PlanError("precision='bf16-mixed' does not combine with "
                            "moe.adaptive_recompute_threshold yet (its two compiled variants "
                            "would each keep master weights); turn one of them off")
        self.model = model
        self.plan = plan
        self.mesh = mesh or Mesh.from_plan(plan)
        self.threshold = plan.moe.adaptive_recompute_threshold
        self.ep = ep or plan.ep
        """The EP degree the token counts are for (on one device: the one planned)."""
        fast, slow = variant_plans(plan)
        self.variants = {"fast": Step(model, fast, self.mesh),
                         "recompute": Step(model, slow, self.mesh)}
        self.guard = self.variants["fast"].guard  # one policy for both (the setter)
        self.decisions: list[dict] = []
        self.last = self.variants["fast"]
        """The variant the last step ran (its gradients are the ones to clip)."""

    def parameters(self):
        return self.last.parameters()

    def named_parameters(self):
        return self.last.named_parameters()

    def model_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.last.model_parameters()

    @property
    def data_parallel(self):
        return self.last.data_parallel

    @property
    def master_weights(self):
        return self.last.master_weights

    @property
    def layouts(self):
        return self.last.layouts

    def executors(self):
        return [e for step in self.variants.values() for e in step.executors()]

    def prepare(self, *args, **kwargs) -> None:
        """Compile both variants for these inputs' signature."""
        for step in self.variants.values():
            step.prepare(*args, **kwargs)

    def eval_loss(self, *args, **kwargs) -> torch.Tensor:
        return self.variants["fast"].eval_loss(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.last.clip_grad_norm_(max_norm)

    @property
    def guard(self):
        return self.variants["fast"].guard

    @guard.setter
    def guard(self, guard) -> None:
        """One policy (and one history of events) for both variants."""
        for step in self.variants.values():
            step.guard = guard

    def check_health(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int):
        """`Step.check_health` of the variant the last step ran."""
        return self.last.check_health(loss, grad_norm, step)

    def sync_parameters(self) -> None:
        for step in self.variants.values():
            step.sync_parameters()

    def set_monitor(self, monitor) -> None:
        """Both variants time into `monitor` (`Step.set_monitor`)."""
        for step in self.variants.values():
            step.set_monitor(monitor)

    def decide(self, tokens: torch.Tensor) -> dict:
        counts = count_tokens_per_rank(self.model, tokens, self.ep)
        peak = int(counts.max()) if counts.numel() else 0
        heavy = peak > self.threshold
        variant = "recompute" if heavy else "fast"
        reason = (f"max tokens on one EP rank = {peak} "
                  f"{'>' if heavy else '<='} threshold {self.threshold} (ep={self.ep})")
        return {"step": len(self.decisions), "max_tokens": peak, "threshold": self.threshold,
                "variant": variant, "reason": reason}

    def __call__(self, tokens, *args, **kwargs) -> torch.Tensor:
        decision = self.decide(tokens)
        self.decisions.append(decision)
        log.info("step %d runs the %s variant: %s", decision["step"], decision["variant"],
                 decision["reason"])
        self.prepare(tokens, *args, **kwargs)  # both ahead, for this signature
        self.last = self.variants[decision["variant"]]
        return self.last(tokens, *args, **kwargs)
