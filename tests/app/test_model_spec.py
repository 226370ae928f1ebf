"""`--model` resolved once (`mxgraph/train/model_spec.py`, its classification
`mxgraph.hf.models.model_kind`): each kind, what each command takes, each error as one line
in the user's terms."""
import json

import pytest

import models
from mxgraph.cli.main import main
from mxgraph.errors import UserError
from mxgraph.hf.models import model_kind
from mxgraph.train.model_spec import TAKES, resolve_model

LLAMA_TOML = 'family = "llama"\nvocab_size = 300\ndim = 64\nn_layers = 2\nn_heads = 4\nffn_dim = 128\n'
PRESETS = ", ".join(models.list_presets())


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """In the working directory: m.toml (a model file), config.json, model/ (a model
    directory: config.json; the resolver reads no weights), empty/ (a directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.toml").write_text(LLAMA_TOML)
    config = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    (tmp_path / "empty").mkdir()
    return tmp_path


def test_model_kind_is_told_by_spelling_and_path(inputs):
    assert [model_kind(s) for s in ("llama-tiny", "m.toml", "missing.toml", "hf:llama",
                                    "config.json", "missing.json", "model", "empty")] == \
        ["preset", "model_file", "model_file", "hf", "hf_config", "hf_config", "pretrained",
         "preset"]


def test_preset_gets_its_config_with_the_overrides():
    spec = resolve_model("llama-tiny", "n_layers=1,vocab_size=300", command="train")
    assert (spec.kind, spec.name, spec.overrides) == ("preset", "llama-tiny",
                                                     {"n_layers": 1, "vocab_size": 300})
    assert spec.config == models.LlamaConfig(**{**vars(models.preset_config("llama-tiny")),
                                                "n_layers": 1, "vocab_size": 300})
    assert spec.vocab_size() == 300 and not spec.is_hf


def test_model_file_gets_its_config(inputs):
    spec = resolve_model("m.toml", command="search")
    assert spec.kind == "model_file" and spec.config == models.LlamaConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, ffn_dim=128)


def test_hugging_face_kinds_name_the_config_they_read(inputs):
    hf = resolve_model("hf:llama", "vocab_size=310", command="train")
    assert (hf.kind, hf.config_source, hf.directory, hf.config) == ("hf", "hf:llama", None, None)
    config = resolve_model("config.json", command="train")
    assert (config.kind, config.config_source) == ("hf_config", "config.json")
    pretrained = resolve_model("model", "num_hidden_layers=2", command="train")
    assert (pretrained.kind, pretrained.directory, pretrained.config_source) == \
        ("pretrained", "model", "model/config.json")
    assert [s.vocab_size() for s in (hf, config, pretrained)] == [310, 320, 320]
    assert pretrained.hf_config().num_hidden_layers == 2


@pytest.mark.parametrize("text, command, message", [
    ("m.toml", "train", "--model m.toml is a TOML model file; mxgraph train takes a preset, a "
                        "Hugging Face model_type (hf:<model_type>), a Hugging Face config.json "
                        "or a model directory (config.json + model.safetensors)"),
    ("hf:llama", "search", "--model hf:llama is a Hugging Face model_type (hf:<model_type>); "
                           "mxgraph search takes a preset or a TOML model file"),
    ("config.json", "search", "--model config.json is a Hugging Face config.json; mxgraph "
                              "search takes a preset or a TOML model file"),
    ("model", "search", "--model model is a model directory (config.json + "
                        "model.safetensors); mxgraph search takes a preset or a TOML model file"),
    ("m.toml", "inspect --memory", "--model m.toml is a TOML model file; mxgraph inspect "
                                   "--memory takes a preset"),
    ("llama-tny", "train", f"unknown model preset 'llama-tny'; did you mean 'llama-tiny'? "
                           f"known presets: {PRESETS}"),
    ("llama-tny", "search", f"unknown model preset 'llama-tny'; did you mean 'llama-tiny'? "
                            f"known presets: {PRESETS}; or pass a TOML model file (family = "
                            f"\"llama\" plus its config fields)"),
    ("empty", "train", "--model empty is a directory without config.json; a pretrained model "
                       "directory holds config.json and model.safetensors (save it with "
                       "save_pretrained(DIR))"),
    ("missing.toml", "search", "model file missing.toml does not exist; pass a preset name or "
                               "a TOML model file"),
])
def test_errors_are_one_line_naming_what_the_command_takes(inputs, text, command, message):
    with pytest.raises(UserError) as error:
        resolve_model(text, command=command)
    assert str(error.value) == message


@pytest.mark.parametrize("model_config, message", [
    ("n_layer=1", "--model-config n_layer is no field of llama-tiny's LlamaConfig; its "
                  "fields: vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_dim, "
                  "max_seq_len, rope_theta, norm_eps, tie_embeddings, init_std"),
    ("dim=130", "--model-config for llama-tiny: dim 130 not divisible by n_heads 4"),
    ("n_layers", "--model-config item 'n_layers' is not key=value; write e.g. "
                 "hidden_size=64,num_hidden_layers=2"),
])
def test_bad_overrides_of_a_preset_are_one_line(model_config, message):
    with pytest.raises(UserError) as error:
        resolve_model("llama-tiny", model_config, command="train")
    assert str(error.value) == message


def test_every_command_takes_a_preset():
    assert all("preset" in kinds for kinds in TAKES.values())


@pytest.mark.parametrize("argv, message", [
    (["search", "--model", "hf:llama", "--gpus", "2", "--global-batch", "2", "--seq-len", "8"],
     "--model hf:llama is a Hugging Face model_type (hf:<model_type>); mxgraph search takes "
     "a preset or a TOML model file"),
    (["inspect", "--comm", "--model", "model"],
     "--model model is a model directory (config.json + model.safetensors); mxgraph inspect "
     "--comm takes a preset"),
    (["train", "--model", "m.toml"], "--model m.toml is a TOML model file; mxgraph train takes"),
])
def test_commands_refuse_a_kind_they_do_not_take_in_one_line(inputs, capfd, argv, message):
    assert main(argv) == 2
    out, err = capfd.readouterr()
    assert out == "" and err.startswith(f"mxgraph: error: {message}") and err.count("\n") == 1
