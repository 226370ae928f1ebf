"""The one place that knows the layout of a Hugging Face model directory: what
`save_pretrained` writes, `pretrained.py` reads, `export.py` writes back, and
`mxgraph.data.token_file` hashes; and the hint that installs what reads it.

    DIR/config.json                          CONFIG: the model's config (model_type, sizes)
    DIR/model.safetensors                    WEIGHTS: every tensor, or
    DIR/model-00001-of-00003.safetensors...  SHARD, listed by
    DIR/model.safetensors.index.json         INDEX ({"weight_map": {key: shard file}})
    DIR/tokenizer.json, vocab.json, ...      TOKENIZER_FILES
    DIR/generation_config.json               GENERATION_CONFIG

Sits at the bottom of `mxgraph.hf`: it imports nothing of mxgraph.
"""
from __future__ import annotations

import os
from fnmatch import fnmatchcase

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = "model-{index:05d}-of-{count:05d}.safetensors"
"""Shard `index` (from 1) of `count`, as `save_pretrained` names them."""
GENERATION_CONFIG = "generation_config.json"
"""Not the tokenizer's, but it travels with it: `export` copies it too."""

TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                   "merges.txt", "chat_template.*")
"""Name patterns (`fnmatch`, case-sensitive) of the files a saved tokenizer may hold: the
fast tokenizer's (tokenizer.json, tokenizer_config.json), a slow one's vocabularies
(tokenizer.model, vocab.json, vocab.txt, merges.txt) and the chat template. `export`
copies them; `token_file` hashes them (with the tokenizer class's own vocabulary files)."""
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
"""The tokenizer files of which either one makes a directory a saved tokenizer (what
`AutoTokenizer.from_pretrained` needs)."""

HF_INSTALL_HINT = "pip install mxgraph[hf]"
"""How to install what reads and writes these directories (transformers, safetensors)."""


def is_model_dir(path: str) -> bool:
    """Whether `path` is a model directory: a directory holding a config.json."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def is_tokenizer_file(name: str) -> bool:
    """Whether the file `name` (no directory) is one of `TOKENIZER_FILES`."""
    return any(fnmatchcase(name, pattern) for pattern in TOKENIZER_FILES)


def shard_names(count: int) -> list[str]:
    """The weight files of a model saved in `count` files: `WEIGHTS`, or `count` shards."""
    if count == 1:
        return [WEIGHTS]
    return [SHARD.format(index=i + 1, count=count) for i in range(count)]
