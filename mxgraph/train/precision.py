"""`mxgraph train --precision` (and its older spelling `--dtype`): which precision a run
trains in, and the plan that carries it (runtime/precision.py says what each holds).

    plan = plan_with_precision(plan, cfg.precision, cfg.dtype, cfg.eager)  # default fp32
    dtype = PARAM_DTYPE[plan.precision]                                    # the model's
"""
from __future__ import annotations

import dataclasses

from mxgraph.errors import UserError
from mxgraph.plan import PRECISIONS, Plan

DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}
"""--dtype values and the precision each always meant (bfloat16: pure bf16)."""


def check_precision_flags(precision: str | None, dtype: str | None) -> str | None:
    """The precision --precision and --dtype ask for (either, or both if they agree; None:
    neither); UserError for an unknown value or a disagreement."""
    if precision is not None and precision not in PRECISIONS:
        raise UserError(f"--precision {precision} is unknown; use one of {', '.join(PRECISIONS)}")
    if dtype is not None and dtype not in DTYPE_ALIASES:
        raise UserError(f"--dtype {dtype} is not a training dtype; use float32 or bfloat16 "
                        f"(or --precision {'|'.join(PRECISIONS)})")
    implied = DTYPE_ALIASES.get(dtype) if dtype is not None else None
    if precision is not None and implied is not None and precision != implied:
        raise UserError(f"--dtype {dtype} means --precision {implied}, but --precision "
                        f"{precision} was given; drop --dtype (--precision replaces it)")
    return precision or implied


def plan_with_precision(plan: Plan, precision: str | None, dtype: str | None = None,
                        eager: bool = False, source: str | None = None) -> Plan:
    """`plan` with the run's precision: the flags' (`check_precision_flags`), else the plan
    file's, else fp32. UserError when the flags and the plan file disagree, or for
    bf16-mixed with --eager (the master weights live in the compiled step)."""
    asked = check_precision_flags(precision, dtype)
    if asked is not None and plan.precision is not None and plan.precision != asked:
        raise UserError(f"{source or 'the plan'} sets precision = {plan.precision!r} but the "
                        f"command line asks for {asked}; make them agree (or drop one)")
    chosen = asked or plan.precision or "fp32"
    if chosen == "bf16-mixed" and eager:
        raise UserError("--precision bf16-mixed keeps its fp32 master weights in the compiled "
                        "step; drop --eager, or use --precision bf16 or fp32 with --eager")
    return dataclasses.replace(plan, precision=chosen)
