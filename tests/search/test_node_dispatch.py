"""A dispatcher that sends a token once per node (`Setting.node_dispatch`, DeepEP's and
DeepSeek-V3's): the share of the expert all-to-all's bytes that leaves a node against its
theory (distinct nodes among a token's experts under uniform routing, capped by
group-limited routing), and the collective and the predicted step it shortens."""
from __future__ import annotations

import dataclasses

import pytest

import models
from mxgraph.devices.catalog import load_device
from mxgraph.plan import Plan
from mxgraph.search.part_time import comm_time, node_dispatch_share
from mxgraph.search.predict import predict
from mxgraph.search.setting import Setting

H100 = load_device("h100-sxm")
DSV3 = models.preset_config("deepseek-v3-671b")  # topk 8 of 256 experts, 4 of 8 groups


def test_group_limited_routing_reaches_at_most_its_groups_nodes():
    # ep64 over 8 nodes, one expert group a node: a token reaches 4 nodes, its 8 experts
    # fall on 4 (1 - (3/4)^8) of them, 7/8 of those remote, one copy each of the 8
    share = node_dispatch_share(DSV3, 64, 8)
    assert share == pytest.approx(4 * (1 - 0.75 ** 8) * 7 / 8 / 8, rel=1e-12)
    assert share < (64 - 8) / 64  # one copy per expert: every remote expert's copy leaves


def test_groups_split_over_nodes_do_not_cap_the_nodes():
    # 8 groups over 16 nodes: a group spans two nodes, so any of the 16 may be reached
    share = node_dispatch_share(DSV3, 128, 8)
    assert share == pytest.approx(16 * (1 - (15 / 16) ** 8) * 15 / 16 / 8, rel=1e-12)
    plain = dataclasses.replace(DSV3, n_groups=1, topk_groups=1)  # no group limit
    assert node_dispatch_share(plain, 64, 8) == pytest.approx(
        8 * (1 - (7 / 8) ** 8) * 7 / 8 / 8, rel=1e-12)


def _setting(node_dispatch: bool, device=H100, gpus: int = 64) -> Setting:
    return Setting(DSV3, device, gpus, gpus, 4096, models, node_dispatch=node_dispatch)


def test_the_all_to_all_leaving_the_node_is_priced_at_its_share():
    plan, nbytes = Plan(dp=64, ep=64), 4096 * 8 * 7168 * 2  # a micro-batch's dispatch
    sent_once = comm_time(_setting(True), plan, "ep", "all_to_all", nbytes)
    per_expert = comm_time(_setting(False), plan, "ep", "all_to_all", nbytes)
    leaves = node_dispatch_share(DSV3, 64, 8)
    wire = max(leaves * nbytes / H100.inter_bw, 63 / 64 * nbytes / H100.intra_bw)
    latency = 7 * H100.inter_latency_s + 56 * H100.intra_latency_s
    assert sent_once == pytest.approx(latency + wire / H100.comm_efficiency, rel=1e-12)
    assert per_expert == pytest.approx(
        latency + 56 / 64 * nbytes / H100.inter_bw / H100.comm_efficiency, rel=1e-12)
    # within one node there is nothing to send once: the same all-to-all either way
    plan8 = Plan(dp=8, ep=8)
    assert comm_time(_setting(True, gpus=8), plan8, "ep", "all_to_all", nbytes) == \
        comm_time(_setting(False, gpus=8), plan8, "ep", "all_to_all", nbytes)


def test_a_moe_step_across_nodes_exposes_less_all_to_all():
    two_a_node = dataclasses.replace(H100, gpus_per_node=2)  # ep4 over 2 nodes
    config = models.preset_config("moe-tiny")

    def step(node_dispatch):
        setting = Setting(config, two_a_node, 4, 8, 64, models, node_dispatch=node_dispatch)
        return predict(setting, Plan(dp=4, ep=4), 1)
    sent_once, per_expert = step(True), step(False)
    assert 0 < sent_once.breakdown_s["layer_comm"] < per_expert.breakdown_s["layer_comm"]
    assert sent_once.breakdown_s["gemm"] == per_expert.breakdown_s["gemm"]
