"""Pretrained Hugging Face weights in (`mxgraph/hf/pretrained.py`): the model `mxgraph.hf.load`
builds from a directory and `load_weights` fills after compile has the loss of
transformers' own `AutoModelForCausalLM.from_pretrained(DIR)` on the same batch, under
tp=2 (untied and tied embeddings), ep=2 (Mixtral: its per-expert checkpoint tensors merged
into fused experts), pp=2 and zero1, each rank having read only its slices.

Tolerance: 1e-5 relative on the fp32 loss (tp, ep and the pipeline sum in another order
than one process). One 2-rank launch runs every plan in turn (start-up dominates).
"""
import pytest
import torch

from mxgraph.errors import UserError
from mxgraph.hf.models import HFCausalLM
from tests.distributed import run_ranks
from tests.hf_checkpoint_dirs import MODEL_VOCAB, save_model_dir

LOSS_RTOL = 1e-5
BATCH, SEQ = 4, 16


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL_VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def hf_loss(directory, inputs, targets) -> float:
    """The loss of transformers' own loading of `directory`, as `HFCausalLM` computes it."""
    from transformers import AutoModelForCausalLM
    return HFCausalLM(AutoModelForCausalLM.from_pretrained(directory))(inputs, targets).item()


def _every_plan(rank, world, cases):
    import mxgraph
    import mxgraph.hf
    from mxgraph.hf.pretrained import load_weights
    from mxgraph.plan import Plan
    from mxgraph.train.loop import release_other_stages
    inputs, targets = _batch()
    for directory, plan, reference in cases:
        model = mxgraph.hf.load(directory)
        step = mxgraph.compile(model, Plan(**plan))
        step.prepare(inputs, targets)
        if step.plan.pp > 1:
            release_other_stages(model, step)
        load_weights(model, step)
        optimizer = torch.optim.SGD(step.parameters(), lr=0.0)  # zero1: shards after the load
        loss = step(inputs, targets).item()
        optimizer.zero_grad()
        assert loss == pytest.approx(reference, rel=LOSS_RTOL), (directory, plan, loss, reference)


@pytest.mark.slow
def test_loaded_model_has_the_hf_loss_under_every_layout(tmp_path):
    llama = save_model_dir(tmp_path / "llama", "llama")
    tied = save_model_dir(tmp_path / "tied", "llama", tie_word_embeddings=True)
    mixtral = save_model_dir(tmp_path / "mixtral", "mixtral")
    inputs, targets = _batch()
    loss = {d: hf_loss(d, inputs, targets) for d in (llama, tied, mixtral)}
    cases = [(str(llama), dict(tp=2), loss[llama]), (str(tied), dict(tp=2), loss[tied]),
             (str(mixtral), dict(ep=2), loss[mixtral]),
             (str(llama), dict(pp=2, micro_batches=2), loss[llama]),
             (str(llama), dict(zero1=True), loss[llama])]
    run_ranks(2, _every_plan, cases)


def test_eager_load_equals_from_pretrained(tmp_path):
    """Without compile (`--eager`): every parameter and buffer equals transformers' own
    loading, bitwise (the Mixtral experts assembled from the per-expert tensors)."""
    from transformers import AutoModelForCausalLM

    import mxgraph
    import mxgraph.hf
    from mxgraph.hf.pretrained import load_weights
    directory = save_model_dir(tmp_path / "mixtral", "mixtral")
    model = mxgraph.hf.load(str(directory))
    load_weights(model)
    reference = AutoModelForCausalLM.from_pretrained(directory)
    ours = dict(model.model.named_parameters()) | dict(model.model.named_buffers())
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_directory_without_weights_is_one_line_error(tmp_path, capsys):
    from mxgraph.cli.main import main
    directory = save_model_dir(tmp_path / "llama", "llama")
    (directory / "model.safetensors").unlink()
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["train", "--model", str(directory), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no model.safetensors or model.safetensors.index.json" \
        in err, err


def test_unexpected_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    import mxgraph
    import mxgraph.hf
    from mxgraph.hf.pretrained import load_weights
    directory = save_model_dir(tmp_path / "llama", "llama")
    save_file({"model.extra.weight": torch.zeros(2)}, str(directory / "model.safetensors"))
    with pytest.raises(UserError, match="model.extra.weight"):
        load_weights(mxgraph.hf.load(str(directory)))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    import mxgraph.hf
    from mxgraph.hf.pretrained import load_weights
    directory = save_model_dir(tmp_path / "llama", "llama")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(UserError, match="has no tensor model.norm.weight"):
        load_weights(mxgraph.hf.load(str(directory)))


def test_sharded_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """A directory of several safetensors files with model.safetensors.index.json (as
    save_pretrained writes above max_shard_size): every parameter bitwise as transformers'."""
    from transformers import AutoModelForCausalLM

    import mxgraph.hf
    from mxgraph.hf.pretrained import load_weights
    AutoModelForCausalLM.from_pretrained(save_model_dir(tmp_path / "one", "llama")) \
        .save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = mxgraph.hf.load(str(tmp_path / "sharded"))
    load_weights(model)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    for name, tensor in reference.named_parameters():
        assert torch.equal(model.model.get_parameter(name), tensor), name
