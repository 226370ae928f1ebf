"""Bad --data / --tokenizer input: one line `mxgraph: error: ...` naming the fix, status 2,
nothing started (no output, no token file, no model), through `mxgraph.cli.main` as the
entry point calls it (tests/app/test_cli.py runs the same main in processes)."""
import json
import shutil
import sys

import numpy as np
import pytest

from mxgraph.cli.main import main
from mxgraph.data.training_data import training_data
from tests.dataset_files import saved_dataset_documents, write_jsonl, write_parquet
from tests.hf_checkpoint_dirs import TOKENIZER_VOCAB, save_tokenizer

FITS = ["--model-config", f"vocab_size={TOKENIZER_VOCAB}"]
"""llama-tiny with room for the test tokenizer (its own vocabulary, 256, is smaller)."""
DOCUMENTS = ("a .txt file (documents separated by blank lines), a .jsonl file (a JSON object "
             "per line), a .parquet file, or a directory saved by datasets' save_to_disk")

# name: (arguments after `train`, the one line expected on stderr)
ERRORS = {
    "tokenizer larger than the model": (
        ["--data", "docs.jsonl", "--tokenizer", "tok"],
        f"--tokenizer tok has {TOKENIZER_VOCAB} tokens but llama-tiny's embedding has "
        f"vocab_size=256; pick the tokenizer made for this model, or a model with a "
        f"vocabulary of at least {TOKENIZER_VOCAB} (--model-config vocab_size={TOKENIZER_VOCAB})"),
    "JSONL line without the field": (
        ["--data", "body.jsonl", "--tokenizer", "tok", *FITS],
        "body.jsonl line 3 has no field 'text' (its fields: id, body); name the text field "
        "with --data-field NAME"),
    "JSONL line not JSON": (
        ["--data", "broken.jsonl", "--tokenizer", "tok", *FITS],
        "broken.jsonl line 2 is not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)); a .jsonl file holds one JSON object per line"),
    "Parquet without the column": (
        ["--data", "docs.parquet", "--tokenizer", "tok", "--data-field", "body", *FITS],
        "data docs.parquet has no column 'body' (its columns: id, text); name the text column "
        "with --data-field NAME"),
    "unsupported file": (
        ["--data", "notes.csv", "--tokenizer", "tok", *FITS],
        f"data notes.csv: file type .csv is not supported; with a tokenizer --data takes "
        f"{DOCUMENTS} (or a .npy of token ids)"),
    "missing data": (
        ["--data", "missing.jsonl", "--tokenizer", "tok", *FITS],
        f"data missing.jsonl does not exist; with a tokenizer --data takes {DOCUMENTS}"),
    "JSONL without a tokenizer": (
        ["--data", "docs.jsonl"],
        "--data docs.jsonl holds documents to tokenize: pass --tokenizer DIR (the directory "
        "of the model's tokenizer)"),
    "tokenizer without data": (
        ["--tokenizer", "tok", *FITS],
        "--tokenizer tok has nothing to tokenize: the built-in text is read as bytes; pass "
        "--data FILE of documents (.txt, .jsonl, .parquet or a datasets directory), or drop "
        "--tokenizer"),
    "tokenizer that is no directory": (
        ["--data", "docs.jsonl", "--tokenizer", "nowhere", *FITS],
        "--tokenizer nowhere does not exist; pass the directory a tokenizer was saved to "
        "(tokenizer.save_pretrained(DIR), e.g. a model's directory)"),
    "tokenizer without an end-of-text token": (
        ["--data", "docs.jsonl", "--tokenizer", "no_eos", *FITS],
        "--tokenizer no_eos has no end-of-text token (eos_token), which packing puts between "
        "documents; set one: tokenizer.eos_token = '...'; tokenizer.save_pretrained(DIR) (or "
        "\"eos_token\" in its tokenizer_config.json)"),
    "a DatasetDict": (
        ["--data", "dict", "--tokenizer", "tok", *FITS],
        "data dict is a DatasetDict (splits: train, test); pass one split's directory, e.g. "
        "--data dict/train"),
}


@pytest.fixture(autouse=True)
def fresh_console_log(monkeypatch):
    """The mxgraph logger as a fresh `mxgraph` process has it: no console handler yet (an
    earlier test in this worker may have run `train`, which adds one), so stderr holds
    what a user sees."""
    import logging
    logger = logging.getLogger("mxgraph")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data_errors")
    tok = save_tokenizer(directory / "tok")
    no_eos = shutil.copytree(tok, directory / "no_eos")
    config = json.loads((no_eos / "tokenizer_config.json").read_text())
    del config["eos_token"], config["bos_token"]
    (no_eos / "tokenizer_config.json").write_text(json.dumps(config))
    docs = saved_dataset_documents()
    write_jsonl(directory / "docs.jsonl", docs)
    write_jsonl(directory / "short.jsonl", docs[:4])
    write_parquet(directory / "docs.parquet", docs)
    (directory / "body.jsonl").write_text('{"id": 0, "text": "a"}\n\n{"id": 2, "body": "b"}\n')
    (directory / "broken.jsonl").write_text('{"text": "a"}\n{text: b}\n')
    (directory / "notes.csv").write_text("text\nhello\n")
    (directory / "dict").mkdir()
    (directory / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    return directory


def _run(argv, directory, monkeypatch, capfd) -> tuple[int, str, str]:
    monkeypatch.chdir(directory)
    before = sorted(p.name for p in directory.rglob("*"))
    status = main(argv)
    out, err = capfd.readouterr()
    made = [p.name for p in directory.rglob("*") if p.name not in before]
    assert all(name.startswith("short.jsonl.") and name.endswith(".tokens.npy") for name in made), \
        made  # only a complete token file is kept, for data too short to train on
    return status, out, err


@pytest.mark.parametrize("name", ERRORS)
def test_data_error_is_one_line_before_anything_starts(name, inputs, monkeypatch, capfd):
    argv, message = ERRORS[name]
    built = []
    monkeypatch.setattr("mxgraph.train.loop.build_training_model", built.append)
    status, out, err = _run(["train", *argv, "--no-progress"], inputs, monkeypatch, capfd)
    assert (status, out, err) == (2, "", f"mxgraph: error: {message}\n")
    assert not built


def test_data_too_short_for_a_batch_says_how_many_tokens_it_makes(inputs, monkeypatch, capfd):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(inputs / "tok")
    total = sum(len(tokenizer(doc)["input_ids"]) + 1 for doc in saved_dataset_documents()[:4])
    status, out, err = _run(["train", "--data", "short.jsonl", "--tokenizer", "tok",
                             "--seq-len", "64", *FITS, "--no-progress"], inputs, monkeypatch, capfd)
    assert (status, out) == (2, "")
    assert err == (f"mxgraph: error: short.jsonl makes {total} tokens: its training split "
                   f"({int(total * 0.95)} tokens) holds fewer than a batch of 16 sequences of "
                   f"64 + 1; use more data or a smaller --batch-size or --seq-len\n")


@pytest.mark.parametrize("module, argv, message", [
    ("pyarrow", ["--data", "docs.parquet", "--tokenizer", "tok", *FITS],
     "reading .parquet files and datasets directories needs pyarrow: pip install mxgraph[data]"),
    ("transformers", ["--data", "docs.jsonl", "--tokenizer", "tok", *FITS],
     "--tokenizer needs the transformers package: pip install mxgraph[hf]"),
])
def test_a_missing_optional_package_names_its_install(module, argv, message, inputs,
                                                      monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    status, out, err = _run(["train", *argv, "--no-progress"], inputs, monkeypatch, capfd)
    assert (status, out, err) == (2, "", f"mxgraph: error: {message}\n")


def test_without_a_tokenizer_a_file_is_bytes_and_a_npy_ids_as_before(inputs):
    np.save(inputs / "ids.npy", np.arange(300, dtype=np.int32))
    (inputs / "bytes.txt").write_bytes(b"some bytes\n\nto train on")
    for name, want in (("bytes.txt", list(b"some bytes\n\nto train on")),
                       ("notes.csv", list(b"text\nhello\n")), ("ids.npy", list(range(300)))):
        data = training_data(str(inputs / name), None, "text", "llama-tiny",
                             lambda: pytest.fail("no tokenizer: no vocabulary check"), 2, 4)
        assert not data.packed and data.tokens.tolist() == want, name


def test_a_data_file_pyarrow_cannot_read_is_one_line_naming_it(inputs, monkeypatch, capfd):
    (inputs / "junk.parquet").write_bytes(b"not parquet")
    saved = inputs / "saved"
    saved.mkdir(exist_ok=True)
    (saved / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (saved / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    for data, start in (("junk.parquet", "junk.parquet: not a readable Parquet file ("),
                        ("saved", "saved/data-00000-of-00001.arrow: not an Arrow stream as "
                                  "save_to_disk writes (")):
        status, out, err = _run(["train", "--data", data, "--tokenizer", "tok", *FITS],
                                inputs, monkeypatch, capfd)
        assert (status, out) == (2, "") and err.count("\n") == 1, err
        assert err.startswith(f"mxgraph: error: {start}"), err
