"""`Plan`: how one training step is laid out and rewritten.

A Plan is a typed, keyword-only dataclass; every field has a docstring (it becomes CLI
help). `validate()` checks what can be checked without a model; the compiler checks the
rest against the traced graph. A field that asks for a capability not built yet raises
`PlanError` naming the field, never a silent default.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from mxgraph.errors import PlanError
from mxgraph.plan_options import DROP_POLICIES, MoEOptions, OverlapOptions

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "dualpipev")
RECOMPUTE_KINDS = ("norm", "act", "attn", "mlp", "moe_light", "moe_medium", "moe_full", "op_sac",
                   "full")
OFFLOAD_KINDS = ("all", "attn", "mlp", "norm", "act", "moe")
CODEGENS = ("auto", "python", "inductor")
"""`Plan.codegen` choices."""

PRECISIONS = ("fp32", "bf16-mixed", "bf16")  # `Plan.precision`; runtime/precision.py: what each holds
FUSION_KINDS = ("swiglu", "bias_gelu", "bias_dropout_add", "rope", "gqa", "rmsnorm",
                "linear_cross_entropy", "moe_permute", "moe_router")


def inductor_generates_for(device_type: str) -> bool:
    """Whether Inductor generates code for `device_type` here: Triton on a GPU (cuda,
    MXMACA's too, and xpu), C++ on the CPU when a C++ compiler is on the PATH."""
    if device_type == "cpu":
        return any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++"))
    return device_type in ("cuda", "xpu")


@dataclass(kw_only=True)
class Plan:
    """The parallel layout and the rewrites of one training step.

    Axes multiply to the world size: `tp * pp * dp * cp`. EP reuses data-parallel ranks
    for experts (as in Megatron-LM): `ep` divides `dp`, each group of `ep` neighbouring
    data-parallel ranks splits the routed experts, and the `dp / ep` ranks holding the
    same experts average their gradients.
    """

    tp: int = 1
    """Tensor-parallel degree: splits attention heads and FFN width across ranks."""
    pp: int = 1
    """Pipeline-parallel degree: number of pipeline ranks."""
    vpp: int = 1
    """Virtual stages per pipeline rank (interleaved and DualPipeV schedules)."""
    dp: int | None = None
    """Data-parallel degree; None = world size / (tp * pp * cp)."""
    ep: int = 1
    """Expert-parallel degree: routed experts are split across this many ranks."""
    cp: int = 1
    """Context-parallel degree: the sequence is split across this many ranks."""
    sequence_parallel: bool = False
    """With tp > 1: norms, dropout and residuals work on sequence shards."""
    strict_sharding: bool = False
    """Raise PlanError where a sharding pass (tp, cp) meets an op it has no rule for, or
    that cannot keep its input's shard, instead of gathering the input there (correct but
    slower; each such op is listed in the dump's findings.txt either way)."""
    zero1: bool = False
    """Shard optimizer state over the data-parallel ranks (ZeRO stage 1): `step.parameters()`
    are then this rank's flat shards, one per gradient bucket (see runtime/data_parallel/buckets.py)."""
    precision: str | None = None
    """None = the parameters' own dtype; "fp32" or "bf16" (pure) cast them at compile; "bf16-mixed": bf16 parameters
    in the step, fp32 gradients and master weights (`step.parameters()`) for the optimizer; runtime/precision.py."""
    bucket_mb: float = 25.0
    """Size cap in MiB of a gradient bucket: data-parallel gradients move in one collective
    per bucket."""
    micro_batches: int = 1
    """Micro-batches per step (pipeline schedules and gradient accumulation)."""
    schedule: str = "1f1b"
    """Pipeline schedule: one of gpipe, 1f1b, interleaved, zbh1, dualpipev."""
    layout: str | None = None
    """Explicit stage layout, e.g. "E t*3 | t*4 | t L"; None = balanced by cost."""
    empty_layers: bool = False
    """Pad the layer count with placeholder layers so every virtual stage is even."""
    recompute: str = ""
    """Comma-separated recompute policy: norm, act, attn, mlp, moe_light, moe_medium,
    moe_full, op_sac, full; empty = save everything. `op_sac` is torchtitan's per-op
    selective checkpointing (`selective_ac_option = "op"`): each layer recomputes
    everything but its outputs, its attention outputs and every other projection's output
    (the 1st, 3rd, ... in forward order), so the backward reruns the even-numbered
    projections' GEMMs too."""
    recompute_stages: dict[int, str] = field(default_factory=dict)
    """Per-stage override of `recompute`, e.g. {0: "full"}."""
    memory_budget: int | None = None
    """Activation-memory budget in bytes; the remat pass picks what to recompute."""
    offload: str = ""
    """Activation offload: "all" or a comma list of kinds (attn, mlp, norm, act, moe), each
    optionally scoped "stageN:kind" or "layerN:kind" (e.g. "stage0:all"); empty = off."""
    offload_prefetch: int = 1
    """Backward nodes between the prefetch of an offloaded value and its first use."""
    fusion: bool | str = False
    """Flash Fusion: True = the fused kernels that pay on the device (under Inductor
    codegen, the kinds whose kernels Inductor's own code beats there are left to it: on an
    NVIDIA GPU most, on the CPU gqa, swiglu, rope and linear_cross_entropy:
    `passes.fusion.fuse.LEFT_TO_INDUCTOR`, named in the dump), False = none, or a comma
    list of names (`FUSION_KINDS`), each fused as asked."""
    codegen: str = "auto"
    """How each program (a stage's F, B and W pieces) runs: "python" (fx's Python code, one
    ATen call per line), "inductor" (fused C++ loops on the CPU, Triton kernels on a GPU;
    tens of seconds of compile per program, once: Inductor's FX graph cache keeps it), or
    "auto" (the default; `codegen_for`): Inductor wherever it generates code for the device
    (a GPU; the CPU when a C++ compiler is on the PATH), else Python. On 2 CPU cores
    (benchmarks/bench_compile.py, llama-20m, batch 4 x 256) Inductor codegen ran a step in
    704 ms against Python codegen's 786 and torch.compile's 687. A program
    that calls back into the executor (overlapped DP buckets, ZeRO-1, timing points,
    DualPipeV's pausing waits) is lowered in segments between the calls. A program Inductor
    refuses (expert parallelism's, on torch 2.13) runs as Python with a warning (an error
    under MXGRAPH_STRICT=1): codegen/inductor.py. Under Inductor codegen a plan with no
    `recompute`, `recompute_stages`, `memory_budget` or `offload` recomputes in the
    backward what torch.compile's min-cut partitioner would (the `auto_remat` pass; off
    with `disable_passes=["auto_remat"]`): bitwise the same values, fewer saved bytes."""
    overlap: bool | OverlapOptions | None = None
    """Communication-compute overlap: None/False = off, True = `OverlapOptions()`, or an
    `OverlapOptions` (a dict, or an [overlap] table in TOML)."""
    moe: MoEOptions = field(default_factory=MoEOptions)
    """Mixture-of-Experts options."""
    dump_dir: str | None = None
    """Write the graph after every pass here (also set by MXGRAPH_DUMP)."""
    disable_passes: tuple[str, ...] = ()
    """Pass names to skip, for bisecting a problem."""

    def __post_init__(self):
        self.disable_passes = tuple(self.disable_passes)
        if isinstance(self.moe, dict):
            check_fields(self.moe, MoEOptions, prefix="moe.")
            self.moe = MoEOptions(**self.moe)
        if isinstance(self.overlap, dict):
            check_fields(self.overlap, OverlapOptions, prefix="overlap.")
            self.overlap = OverlapOptions(**self.overlap)
        elif self.overlap is True:
            self.overlap = OverlapOptions()
        elif self.overlap is False:
            self.overlap = None
        self.validate()

    # ---- validation -------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> "Plan":
        """Check the fields alone, and against `world_size` when given; returns self."""
        for name in ("tp", "pp", "vpp", "ep", "cp", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise PlanError(f"dp={self.dp!r} must be a positive integer or None (= derived)")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule={self.schedule!r} is unknown; choose one of {SCHEDULES}")
        if self.vpp > 1 and self.schedule not in ("interleaved", "dualpipev"):
            raise PlanError(f"vpp={self.vpp} needs schedule='interleaved' or 'dualpipev', "
                            f"not {self.schedule!r}; or set vpp=1")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel=True needs tp > 1; set tp or turn it off")
        for kind in parse_list(self.recompute):
            _check_choice("recompute", kind, RECOMPUTE_KINDS)
        for stage, policy in self.recompute_stages.items():
            for kind in parse_list(policy):
                _check_choice(f"recompute_stages[{stage}]", kind, RECOMPUTE_KINDS)
        parse_offload(self.offload)
        if not isinstance(self.offload_prefetch, int) or self.offload_prefetch < 0:
            raise PlanError(f"offload_prefetch={self.offload_prefetch!r} must be an integer >= 0")
        for kind in self.fusion_kinds():
            _check_choice("fusion", kind, FUSION_KINDS)
        _check_choice("codegen", self.codegen, CODEGENS)
        if self.overlap is not None:
            _check_overlap(self)
        if not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise PlanError(f"bucket_mb={self.bucket_mb!r} must be a positive number of MiB "
                            f"(e.g. 25.0)")
        _check_moe(self)
        if self.ep > 1 and self.moe.adaptive_recompute_threshold is not None:
            raise PlanError(f"moe.adaptive_recompute_threshold with ep={self.ep} is not built: the "
                            "step counts each EP rank's tokens by routing with the eager model, "
                            "whose experts ep shards; use it with ep=1 (AdaptiveMoEStep(model, "
                            "plan, ep=N) counts for a planned ep=N) or drop the threshold")
        if self.zero1 and self.moe.adaptive_recompute_threshold is not None:
            raise PlanError("zero1 does not combine with moe.adaptive_recompute_threshold yet "
                            "(its two compiled variants would each shard the optimizer "
                            "state); turn one of them off")
        _check_choice("precision", self.precision or "fp32", PRECISIONS)
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise PlanError(f"memory_budget={self.memory_budget} must be a positive byte count")
        if world_size is not None:
            self.resolve_dp(world_size)
        return self

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel degree for `world_size` ranks; PlanError if axes don't fit."""
        model_ranks = self.tp * self.pp * self.cp
        if world_size % model_ranks:
            raise PlanError(
                f"world size {world_size} is not divisible by tp*pp*cp = {model_ranks}; "
                f"launch a multiple of {model_ranks} processes or change the axes")
        dp = world_size // model_ranks
        if self.dp is not None and self.dp != dp:
            raise PlanError(
                f"dp={self.dp} but world size {world_size} / (tp*pp*cp={model_ranks}) = {dp}; "
                f"set dp={dp} or leave dp unset")
        if dp % self.ep:
            raise PlanError(f"ep={self.ep} does not divide dp = {dp} (expert-parallel ranks "
                            f"are data-parallel ranks); choose ep in {divisors(dp)}")
        return dp

    def codegen_for(self, device_type: str) -> str:
        """"python" or "inductor" for programs on a device of `device_type` ("cpu", "cuda",
        ...): `codegen`, with "auto" Inductor where `inductor_generates_for(device_type)`,
        or what the environment's MXGRAPH_CODEGEN ("python" or "inductor"; empty counts as
        unset) says (to run a whole test suite or a script under one codegen without changing
        its plans)."""
        if self.codegen != "auto":
            return self.codegen
        chosen = os.environ.get("MXGRAPH_CODEGEN")
        if chosen:
            _check_choice("MXGRAPH_CODEGEN", chosen, CODEGENS[1:])
            return chosen
        return "inductor" if inductor_generates_for(device_type) else "python"

    def fusion_kinds(self) -> tuple[str, ...]:
        """The fused-kernel names this plan turns on."""
        if self.fusion is True:
            return FUSION_KINDS
        if not self.fusion:
            return ()
        return parse_list(self.fusion)

    # ---- TOML -------------------------------------------------------------------------
    @classmethod
    def from_toml(cls, path: str | Path) -> "Plan":
        """Read a plan from a TOML file: top-level fields plus an optional [moe] table.

        PlanError naming the file if it is missing, unreadable or not TOML, and as in
        `from_dict` for its fields."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist; pass the path of a TOML file "
                            f"of Plan fields (e.g. a line tp = 2)") from None
        except OSError as error:
            raise PlanError(f"plan file {path} cannot be read ({error.strerror}); pass a "
                            f"readable TOML file") from None
        except tomllib.TOMLDecodeError as error:
            raise PlanError(f"plan file {path} is not valid TOML: {error}; fields are "
                            f"written name = value, e.g. tp = 2 or schedule = \"1f1b\"") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str | None = None) -> "Plan":
        """A Plan from plain values (a TOML document, `to_dict()`). PlanError, prefixed with
        `source`, for an unknown field (naming the nearest known one), a value of the wrong
        type, or a plan that `validate()` refuses."""
        check_fields(data, cls, source)
        data = dict(data)
        if "recompute_stages" in data:
            data["recompute_stages"] = _stage_keys(data["recompute_stages"], source)
        try:
            return cls(**data)
        except PlanError as error:
            raise PlanError(_prefixed(source, str(error))) from None

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["disable_passes"] = list(self.disable_passes)
        return data

    def to_toml(self) -> str:
        """The plan as TOML text (fields left at None are omitted)."""
        lines, tables = [], []
        for key, value in self.to_dict().items():
            if value is None:
                continue
            if isinstance(value, dict):
                body = [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
                tables.append(f"\n[{key}]\n" + "\n".join(body))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "".join(tables) + "\n"


# ---- loading: names and types of plain values -------------------------------------------
_KINDS = {"int": int, "float": (int, float), "str": str, "bool": bool, "None": type(None),
          "dict": dict, "tuple": (list, tuple), "MoEOptions": (dict, MoEOptions),
          "OverlapOptions": (dict, OverlapOptions)}
_KIND_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "a boolean (true/false)", "dict": "a table", "tuple": "a list",
               "MoEOptions": "a [moe] table", "OverlapOptions": "an [overlap] table"}


def check_fields(data: dict, cls: type, source: str | None = None, prefix: str = "") -> None:
    """PlanError unless every key of `data` is a field of dataclass `cls` and its value has
    the field's type; nested dataclass fields (the [moe] table) are checked the same way.
    `prefix` is how the fields are named to the user ("moe.")."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        name = prefix + key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = (f"did you mean {prefix + close[0]!r}?" if close else
                    f"known fields: {', '.join(prefix + k for k in fields)}")
            raise PlanError(_prefixed(source, f"unknown plan field {name!r}; {hint}"))
        kinds = [part.strip().split("[")[0] for part in fields[key].type.split("|")]
        if not any(isinstance(value, _KINDS[kind]) and
                   (kind == "bool" or not isinstance(value, bool)) for kind in kinds):
            raise PlanError(_prefixed(source, (
                f"{name} = {_shown(value)} is {_kind_word(value)}; {name} takes "
                f"{' or '.join(_KIND_WORDS[kind] for kind in kinds if kind != 'None')}")))
        if kinds == ["MoEOptions"] and isinstance(value, dict):
            check_fields(value, MoEOptions, source, prefix=f"{name}.")
        if "OverlapOptions" in kinds and isinstance(value, dict):
            check_fields(value, OverlapOptions, source, prefix=f"{name}.")


def _stage_keys(stages: dict, source: str | None) -> dict[int, str]:
    """recompute_stages with the TOML table's string keys as stage numbers."""
    for key, policy in stages.items():
        if not str(key).isdigit() or not isinstance(policy, str):
            raise PlanError(_prefixed(source, (
                f"recompute_stages maps a stage number to a policy string, e.g. "
                f"recompute_stages = {{0 = \"full\"}}; got {key!r} = {_shown(policy)}")))
    return {int(key): policy for key, policy in stages.items()}


def _prefixed(source: str | None, message: str) -> str:
    return f"{source}: {message}" if source else message


def _shown(value) -> str:
    """A value as the user wrote it in TOML, where it can be written."""
    try:
        return _toml_value(value)
    except PlanError:
        return "a table" if isinstance(value, dict) else repr(value)


def _kind_word(value) -> str:
    """What the user wrote, in TOML's words: "a string" for tp = "two"."""
    for kind, word in ((bool, "a boolean"), (int, "an integer"), (float, "a float"),
                       (str, "a string"), (dict, "a table"), ((list, tuple), "a list")):
        if isinstance(value, kind):
            return word
    return f"a {type(value).__name__}"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise PlanError(f"cannot write {value!r} to TOML")


def parse_list(text: str) -> tuple[str, ...]:
    """'norm, act' -> ('norm', 'act')."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def parse_offload(text: str) -> list[tuple[str | None, str]]:
    """'attn, stage0:all, layer2:mlp' -> [(None, 'attn'), ('stage0', 'all'), ('layer2', 'mlp')]."""
    entries = []
    for part in parse_list(text):
        scope, _, kind = part.rpartition(":")
        if scope and not re.fullmatch(r"(stage|layer)\d+", scope):
            raise PlanError(f"offload: scope {scope!r} in {part!r} is unknown; write "
                            f"stageN:kind or layerN:kind")
        _check_choice("offload", kind, OFFLOAD_KINDS)
        entries.append((scope or None, kind))
    return entries


def _check_overlap(plan: "Plan") -> None:
    """PlanError for overlap fields that cannot hold (device capabilities are checked at
    compile time, against the mesh's device)."""
    options = plan.overlap
    if not isinstance(options, OverlapOptions):
        raise PlanError(f"overlap={options!r} must be True, False, None or an OverlapOptions "
                        f"(a dict of its fields)")
    budget = options.max_in_flight_mb
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise PlanError(f"overlap.max_in_flight_mb={budget!r} must be a positive number of "
                        f"MiB (e.g. 512)")
    chunks = options.tp_chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PlanError(f"overlap.tp_chunks={chunks!r} must be a positive integer (1 = off)")
    if chunks > 1 and not plan.sequence_parallel:
        raise PlanError(f"overlap.tp_chunks={chunks} splits sequence-parallel all-gathers and "
                        f"reduce-scatters around the TP GEMMs: it needs tp > 1 and "
                        f"sequence_parallel=True; set those or leave tp_chunks at 1")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"{field_name}: {value!r} is unknown; choose from {', '.join(choices)}")


def _check_moe(plan: Plan) -> None:
    """PlanError for MoE options that cannot work (the part that needs the model's expert
    count, hot_experts < experts per rank, is checked when the blocks are found)."""
    moe = plan.moe
    factor = moe.capacity_factor
    if factor is not None and (not isinstance(factor, (int, float)) or not factor > 0):
        raise PlanError(f"moe.capacity_factor={factor!r} must be a number > 0 (e.g. 1.0 or "
                        f"1.25), or None for dropless experts")
    _check_choice("moe.drop_policy", moe.drop_policy, DROP_POLICIES)
    if moe.batched_gemm and factor is None:
        raise PlanError("moe.batched_gemm=True needs moe.capacity_factor (a batched GEMM needs "
                        "every expert padded to the same row count); set capacity_factor, "
                        "e.g. 1.25, or turn batched_gemm off")
    if not isinstance(moe.hot_experts, int) or moe.hot_experts < 0:
        raise PlanError(f"moe.hot_experts={moe.hot_experts!r} must be an integer >= 0 "
                        f"(0 = no replication)")
    if moe.hot_experts and plan.ep == 1:
        raise PlanError(f"moe.hot_experts={moe.hot_experts} replicates experts across expert-"
                        f"parallel ranks, and ep=1 has none; set ep > 1 or hot_experts=0")
    if moe.hot_experts and factor is not None:
        raise PlanError("moe.hot_experts with moe.capacity_factor is not built (capacity-"
                        "padded experts already move equal blocks); use one of them")
    if moe.hot_min_rows is not None and (not isinstance(moe.hot_min_rows, int) or
                                         moe.hot_min_rows < 0):
        raise PlanError(f"moe.hot_min_rows={moe.hot_min_rows!r} must be an integer >= 0, or "
                        f"None for the cost rule")
    if not isinstance(moe.hot_threshold, (int, float)) or moe.hot_threshold < 1:
        raise PlanError(f"moe.hot_threshold={moe.hot_threshold!r} must be >= 1 (max/mean of "
                        f"the per-expert token counts; 1.0 = always replicate)")
    if moe.a2a_overlap and plan.ep == 1:
        raise PlanError("moe.a2a_overlap=True overlaps expert-parallel all-to-alls, and ep=1 "
                        "has none; set ep > 1 or turn a2a_overlap off")
    if moe.a2a_overlap and (plan.overlap is None or not plan.overlap.reorder):
        raise PlanError("moe.a2a_overlap=True needs overlap=True (its asynchronous "
                        "collectives and reorder pass); set overlap=True or turn a2a_overlap off")


def check_divides(axis: str, degree: int, what: str, total: int) -> None:
    """PlanError unless `degree` divides `total`, listing the degrees that would."""
    if total % degree:
        raise PlanError(f"{axis}={degree} does not divide {what}={total}; "
                        f"choose {axis} in {{{', '.join(map(str, divisors(total)))}}}")


# Capabilities not built yet: (field, test on the plan, what is missing). A plan that asks
# for one raises PlanError at compile time; the entry goes when the capability lands.
NOT_BUILT: list = []


def require_built(plan: Plan) -> None:
    """PlanError for the first field that asks for a capability mxgraph lacks so far."""
    for name, asks, what in NOT_BUILT:
        if asks(plan):
            raise PlanError(f"{name}: {what} is not built yet in this version of mxgraph; "
                            f"leave {name} at its default")
