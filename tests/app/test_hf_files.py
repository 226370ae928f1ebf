"""The layout of a Hugging Face model directory (`mxgraph/hf/files.py`): the names
transformers itself writes, the tokenizer files export copies and token files hash."""
import pytest

from mxgraph.data.token_file import tokenizer_hash
from mxgraph.hf.files import CONFIG, INDEX, TOKENIZER_MARKERS, WEIGHTS, is_model_dir, is_tokenizer_file, shard_names


def test_names_are_those_transformers_writes():
    from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    assert (CONFIG, WEIGHTS, INDEX) == (CONFIG_NAME, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    assert shard_names(1) == [WEIGHTS]
    assert shard_names(3)[1] == "model-00002-of-00003.safetensors"


@pytest.mark.parametrize("name, copied", [
    ("tokenizer.json", True), ("tokenizer_config.json", True), ("tokenizer.model", True),
    ("special_tokens_map.json", True), ("added_tokens.json", True), ("vocab.json", True),
    ("vocab.txt", True), ("merges.txt", True), ("chat_template.jinja", True),
    ("config.json", False), ("model.safetensors", False), ("generation_config.json", False),
    ("Tokenizer.json", False), ("README.md", False),
])
def test_tokenizer_files(name, copied):
    assert is_tokenizer_file(name) == copied
    assert all(is_tokenizer_file(marker) for marker in TOKENIZER_MARKERS)


def test_model_dir_is_a_directory_with_a_config(tmp_path):
    assert not is_model_dir(str(tmp_path)) and not is_model_dir(str(tmp_path / "missing"))
    (tmp_path / CONFIG).write_text("{}")
    assert is_model_dir(str(tmp_path)) and not is_model_dir(str(tmp_path / CONFIG))


def test_token_files_hash_every_tokenizer_file_and_nothing_else(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    before = tokenizer_hash(str(tmp_path), tokenizer=None)
    (tmp_path / "README.md").write_text("not the tokenizer's")
    assert tokenizer_hash(str(tmp_path), tokenizer=None) == before
    (tmp_path / "merges.txt").write_text("a b")
    assert tokenizer_hash(str(tmp_path), tokenizer=None) != before
