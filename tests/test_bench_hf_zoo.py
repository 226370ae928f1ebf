"""benchmarks/bench_hf_zoo.py keeps working: the shrinker changes sizes only, the eager check
passes a dense type and an encoder-decoder is skipped (the sample's cells under mxgraph:
tests/parallel/test_hf_zoo_sample.py)."""
import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from hf_zoo import cells  # noqa: E402
from hf_zoo.shrink import role, shrink  # noqa: E402


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mixtral", "gemma3_text"])
def test_shrink_changes_sizes_only(model_type):
    default = CONFIG_MAPPING[model_type]()
    small = shrink(default)
    assert small.use_cache is default.use_cache is True
    assert small._attn_implementation == default._attn_implementation
    before, after = default.to_dict(), small.to_dict()
    changed = [k for k in before if before[k] != after.get(k)]
    assert changed and all(role(k, before[k]) or isinstance(before[k], list) for k in changed), changed
    assert after.get("router_jitter_noise") == before.get("router_jitter_noise")
    assert after.get("hidden_size", after.get("n_embd")) == 64 and after["vocab_size"] == 256


def test_shrink_keeps_one_layer_of_each_kind():
    small = shrink(CONFIG_MAPPING["gemma3_text"]())  # 5 sliding layers, then a full one
    assert small.layer_types == ["sliding_attention", "full_attention"]
    assert small.num_hidden_layers == 2


def test_eager_cell_passes_and_an_encoder_decoder_is_skipped():
    """The one-device cells of the sample run in tests/parallel/test_hf_zoo_sample.py."""
    assert cells.eager_cell("llama")["status"] == "pass"
    assert cells.skip_reason("llama") is None
    assert "encoder-decoder" in cells.skip_reason("bart")


def test_sample_is_in_the_mapping():
    spec = importlib.util.spec_from_file_location("bench_hf_zoo", BENCHMARKS / "bench_hf_zoo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert len(bench.SAMPLE) >= 40 and set(bench.SAMPLE) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
