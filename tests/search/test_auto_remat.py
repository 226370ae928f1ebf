"""The estimators model Inductor codegen's auto remat (passes/memory/auto_remat.py) where
the device they stand for runs it: the search's layer traces and `estimate_memory` save
less under it, and the search prices its recomputed values and decomposed ops as the
fused kernels Inductor makes of them (the priced work stays that of Python codegen, less
the K/V head repeats native_gqa drops)."""
import torch

import models
import mxgraph as mx
from mxgraph.memory_plan import estimate_memory
from mxgraph.search.layer_cost import TraceCache, TraceKey


def test_search_traces_save_less_and_price_the_same_work(monkeypatch):
    config, seq = models.preset_config("llama-tiny"), 64
    costs = {}
    for codegen in ("python", "inductor"):  # what "auto" means on the traced GPU
        monkeypatch.setenv("MXGRAPH_CODEGEN", codegen)
        costs[codegen] = TraceCache(models).layer_costs(config, TraceKey(dtype="bfloat16"), seq)
    plain, auto = costs["python"], costs["inductor"]
    saved = {name: sum(c.saved.device.values()) for name, c in costs.items()}
    assert saved["inductor"] < 0.8 * saved["python"], saved
    assert plain.parts.keys() == auto.parts.keys()
    for key, part in plain.parts.items():
        other = auto.parts[key]
        assert sorted(part.gemms) == sorted(other.gemms) and part.attention == other.attention
        # memory-bound bytes: the same kernels, a decomposed softmax or loss priced as one,
        # less the K/V head repeats that native_gqa hands to SDPA (a few % of a tiny layer)
        assert 0.9 * sum(part.memory) <= sum(other.memory) <= 1.01 * sum(part.memory), key


def test_estimate_memory_follows_the_plans_codegen():
    args = dict(batch_size=2, seq_len=64, dtype=torch.bfloat16)
    python, = estimate_memory("llama-tiny", mx.Plan(codegen="python"), **args)
    inductor, = estimate_memory("llama-tiny", mx.Plan(codegen="inductor"), **args)
    assert inductor.activations < 0.8 * python.activations, (inductor, python)
    assert inductor.params == python.params and inductor.optimizer == python.optimizer
