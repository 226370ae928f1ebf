"""Tiny Hugging Face model directories as a user has them: `save_pretrained` weights
(safetensors), `config.json` and a BPE tokenizer, all made here from built-in text and
random initialisation; nothing is downloaded.

    save_model_dir(tmp_path / "llama", "llama")    # -> the directory
"""
from __future__ import annotations

from pathlib import Path

import torch

from mxgraph.data.batches import stdlib_bytes
from mxgraph.hf.models import TINY

EOS = "<|endoftext|>"
TOKENIZER_VOCAB = 384
"""BPE vocabulary of the test tokenizer: the 256 byte-level symbols, the end-of-text token
and merges learned from built-in text."""
MODEL_VOCAB = 512
"""The saved models' vocabulary: larger than the tokenizer's, as real checkpoints pad it."""


def built_in_text(max_bytes: int = 200_000) -> list[str]:
    """Documents for training the tokenizer: the built-in text cut at blank-line pairs."""
    text = stdlib_bytes(max_bytes).tobytes().decode("utf-8", errors="replace")
    return [doc for doc in text.split("\n\n\n") if doc.strip()]


def save_tokenizer(path: Path, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """A byte-level BPE tokenizer trained on built-in text, saved as transformers saves one
    (tokenizer.json, tokenizer_config.json); its end-of-text token is `EOS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(built_in_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(path)
    return Path(path)


def save_model_dir(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """`family`'s tiny config (`mxgraph.hf.TINY`, vocabulary `MODEL_VOCAB`, its end-of-text
    id the tokenizer's) with `overrides`, randomly initialised under `seed`, saved with
    `save_pretrained` (model.safetensors) beside the test tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    tokenizer = save_tokenizer(path)
    from transformers import AutoTokenizer
    eos = AutoTokenizer.from_pretrained(tokenizer).eos_token_id
    fields = {**TINY[family], "vocab_size": MODEL_VOCAB, "bos_token_id": eos,
              "eos_token_id": eos, **overrides}
    config = AutoConfig.for_model(family, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path
