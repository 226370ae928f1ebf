"""Plan: validation messages, TOML round trip, and refusal of unbuilt capabilities."""
import pytest

import mxgraph as mx
from mxgraph.errors import PlanError
from mxgraph.plan import Plan, check_divides, require_built


def test_toml_round_trip(tmp_path):
    plan = Plan(tp=2, pp=2, vpp=2, schedule="interleaved", recompute="norm,act",
                recompute_stages={0: "full"}, fusion="swiglu,rope",
                moe={"capacity_factor": 1.25}, disable_passes=("dead_code",),
                overlap={"max_in_flight_mb": 64.0, "p2p": False})
    path = tmp_path / "plan.toml"
    path.write_text(plan.to_toml())
    assert Plan.from_toml(path) == plan
    assert Plan(overlap=True).overlap == mx.OverlapOptions() and Plan(overlap=False).overlap is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp=0), ["tp=0", "positive"]),
    (dict(schedule="zb"), ["schedule", "zbh1"]),
    (dict(vpp=2), ["vpp=2", "interleaved"]),
    (dict(sequence_parallel=True), ["sequence_parallel", "tp > 1"]),
    (dict(recompute="norm,everything"), ["recompute", "everything", "norm"]),
    (dict(offload="kv"), ["offload", "'kv'"]),
    (dict(fusion="swigl"), ["fusion", "swiglu"]),
    (dict(ep=2, moe={"adaptive_recompute_threshold": 8}), ["adaptive_recompute_threshold", "ep=1"]),
    (dict(overlap={"max_in_flight_mb": 0}), ["overlap.max_in_flight_mb=0", "positive"]),
    (dict(overlap={"tp_chunks": 2}), ["overlap.tp_chunks=2", "sequence_parallel=True"]),
    (dict(overlap={"reorder": "yes"}), ["overlap.reorder", "boolean"]),
    (dict(overlap={"reordr": True}), ["overlap.reordr", "overlap.reorder"]),
])
def test_bad_fields_name_the_field_and_a_fix(kwargs, words):
    with pytest.raises(PlanError) as info:
        Plan(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_world_size_must_fit_axes():
    with pytest.raises(PlanError, match="not divisible by tp\\*pp\\*cp = 4"):
        Plan(tp=2, pp=2).validate(world_size=6)
    with pytest.raises(PlanError, match="set dp=2"):
        Plan(tp=2, dp=3).validate(world_size=4)
    assert Plan(tp=2).resolve_dp(8) == 4


def test_divisibility_lists_choices():
    with pytest.raises(PlanError, match=r"tp=3 does not divide num_heads=8; choose tp in \{1, 2, 4, 8\}"):
        check_divides("tp", 3, "num_heads", 8)


def test_unknown_toml_field(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("tp = 1\ntensor_parallel = 2\n")
    with pytest.raises(PlanError, match="tensor_parallel"):
        Plan.from_toml(path)


def test_unbuilt_capabilities_are_refused_by_name(monkeypatch):
    """A field in NOT_BUILT is refused by name; the MoE options built since are not."""
    monkeypatch.setattr("mxgraph.plan.NOT_BUILT",
                        [("moe.batched_gemm", lambda p: p.moe.batched_gemm, "batched GEMM")])
    with pytest.raises(PlanError, match="^moe.batched_gemm: batched GEMM is not built yet"):
        require_built(Plan(moe={"capacity_factor": 1.0, "batched_gemm": True}))
    monkeypatch.undo()
    for moe, plan in [({"capacity_factor": 1.0, "batched_gemm": True}, {}),
                      ({"hot_experts": 1}, {"ep": 2}),
                      ({"a2a_overlap": True}, {"ep": 2, "overlap": True})]:
        require_built(Plan(moe=moe, **plan))


def test_compile_refuses_unknown_pass_name():
    import torch
    with pytest.raises(PlanError, match="unknown pass name"):
        mx.compile(torch.nn.Linear(2, 2), Plan(disable_passes=("no_such_pass",)))
