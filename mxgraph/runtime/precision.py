"""Training precision: what each one holds per parameter, and the fp32 master weights of
bf16-mixed training.

    STATE_BYTES["bf16-mixed"]    # bytes per parameter element the run holds (see below)
    master = MasterWeights(step.model_parameters(), zero1=False)
    master.accumulate(param, bf16_grad)  # the executor: into param's fp32 main gradient
    master.to_masters()          # main gradients -> the masters' .grad (what AdamW reads)
    master.copy_to_params()      # masters rounded into the bf16 parameters

Precisions (`Plan.precision`, `mxgraph train --precision`; `plan.PRECISIONS`):

* "fp32": fp32 parameters, gradients and AdamW state (4 + 4 + 8 bytes per parameter).
* "bf16": pure bf16 (what `--dtype bfloat16` always did): bf16 parameters and gradients,
  and AdamW's two moments in the parameters' dtype, bf16 (2 + 2 + 4).
* "bf16-mixed" (Megatron-LM's `--bf16`, torchtitan's FSDP mixed precision): the compiled
  step runs on bf16 parameters; each gradient a backward program produces (bf16) is added
  into an fp32 "main" gradient of its parameter the moment it exists, so micro-batches
  accumulate in fp32 (the bf16 values are the program's transient outputs); data-parallel
  reduction runs on those fp32 buffers (as Megatron-LM forces for bf16:
  `accumulate_allreduce_grads_in_fp32`, because a bf16 sum over many ranks loses the small
  contributions); clipping and AdamW work on fp32 master weights; the masters are copied,
  rounded to the nearest bf16, into the parameters at the start of the next step (and by
  `Step.sync_parameters`). Held per parameter: bf16 value 2 + fp32 main gradient 4 + fp32
  master 4 + AdamW 8 = 18 bytes. Under ZeRO-1 the master, its gradient and AdamW's state
  are the flat shards' (1/dp each, fp32), the main gradients stay whole until the
  reduce-scatter frees them, and the shards are rounded to bf16 before their all-gather
  (half the traffic; rounding element by element, the same values). The masters start as
  the bf16 parameters' values (the model is cast first, as Megatron-LM initialises in bf16).

The loss is fp32 whatever the precision (the models compute the cross-entropy on fp32
logits) and the gradient norm is summed in fp64 and returned in fp32 (`grad_norm.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PARAM_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16}
"""The dtype of the parameters the compiled step runs on."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element a precision holds outside the activations."""

    params: int
    """The parameters the compiled step reads."""
    grads: int
    """Their gradients as kept between backward and optimizer (bf16-mixed: the fp32 main
    gradients; the bf16 ones are transient program outputs)."""
    master: int
    """fp32 master weights (bf16-mixed; / dp under ZeRO-1)."""
    optimizer: int
    """AdamW's exp_avg and exp_avg_sq (/ dp under ZeRO-1)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


STATE_BYTES = {"fp32": StateBytes(params=4, grads=4, master=0, optimizer=8),
               "bf16-mixed": StateBytes(params=2, grads=4, master=4, optimizer=8),
               "bf16": StateBytes(params=2, grads=2, master=0, optimizer=4)}


def holds_returned_grads(precision: str, micro_batches: int) -> bool:
    """Whether a step holds, at its peak, a second gradient per parameter in the parameter
    dtype beside the kept ones: the gradients a backward program returns together, which
    are added into the kept ones after it ends (under bf16-mixed always: into the fp32 main
    gradients; else with several micro-batches: into the earlier ones' sum)."""
    return precision == "bf16-mixed" or micro_batches > 1


def precision_of_dtype(dtype: torch.dtype) -> str:
    """The precision a model whose parameters are `dtype` trains in without a
    `Plan.precision`: its own dtype throughout (bf16 or fp16: pure, 2-byte state)."""
    return "fp32" if dtype == torch.float32 else "bf16"


def cast_parameters_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast `model`'s floating-point parameters to `dtype` in place (same Parameter
    objects, new `.data`); buffers keep theirs (rope tables, router biases: fp32)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


class MasterWeights:
    """bf16-mixed: the fp32 main gradient of each bf16 parameter this rank holds and,
    without ZeRO-1, its fp32 master weight (an `nn.Parameter`: what the optimizer updates).
    Under ZeRO-1 the masters are the data-parallel flat shards (`data_parallel/buckets.py`)."""

    def __init__(self, named_params, zero1: bool):
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.zero1 = zero1
        self.main_grads: dict[int, torch.Tensor] = {}
        """id(parameter) -> its fp32 gradient accumulated so far this step."""
        self.masters: dict[int, torch.nn.Parameter] = {} if zero1 else {
            id(p): torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
            for _, p in self.named}

    def named_masters(self):
        """(parameter name, fp32 master) in the model's parameter order (not under ZeRO-1)."""
        return ((n, self.masters[id(p)]) for n, p in self.named)

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a backward program's (bf16) gradient of `param` into its fp32 main gradient."""
        main = self.main_grads.get(id(param))
        if main is None:
            self.main_grads[id(param)] = torch.empty(
                param.shape, dtype=torch.float32, device=param.device).copy_(grad)
        else:
            main.add_(grad)

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return self.main_grads.get(id(param))

    def set_grad(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Replace `param`'s main gradient (fp32; None drops it)."""
        if grad is None:
            self.main_grads.pop(id(param), None)
        else:
            self.main_grads[id(param)] = grad

    def to_masters(self) -> None:
        """Add the main gradients into the masters' `.grad` (added, like backward) and drop
        them (not under ZeRO-1: the reduce-scatter moved them into the shards)."""
        for _, param in self.named:
            main = self.main_grads.pop(id(param), None)
            if main is None:
                continue
            master = self.masters[id(param)]
            if master.grad is None:
                master.grad = main
            else:
                master.grad.add_(main)

    def copy_to_params(self) -> None:
        """Round each master to the parameter's dtype into the parameter (not ZeRO-1)."""
        with torch.no_grad():
            for _, param in self.named:
                param.copy_(self.masters[id(param)])
