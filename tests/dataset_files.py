"""Documents and data files of every `--data` kind for the data tests, made here (no
download): the same documents as JSONL, .txt, Parquet (pyarrow) and, committed, a directory
that `datasets`' `Dataset.save_to_disk` wrote (tests/data/saved_dataset, made by
tests/data/make_saved_dataset.py)."""
from __future__ import annotations

import json
from pathlib import Path

SAVED_DATASET = Path(__file__).resolve().parent / "data" / "saved_dataset"
"""Written by datasets 5.2.0 `Dataset.from_dict({"title", "text", "n"}).save_to_disk(DIR,
num_shards=2)` from `saved_dataset_documents()`: two Arrow files, state.json."""


def saved_dataset_documents() -> list[str]:
    """40 short documents (the text column of SAVED_DATASET): words, digits, punctuation,
    non-ASCII letters, one empty document, newlines inside some."""
    words = ["the", "graph", "pass", "tensor", "café", "naïve", "Straße", "日本", "42", "x=1;"]
    docs = []
    for i in range(40):
        body = " ".join(words[(i * 7 + j) % len(words)] for j in range(i % 11 + 1))
        docs.append("" if i == 17 else f"Document {i}.\n{body}" if i % 3 else body + "!")
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}, ensure_ascii=False) + "\n")
    return path


def write_parquet(path: Path, docs: list[str], row_group_size: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path
