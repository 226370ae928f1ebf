"""Documents of a `--data` source that a tokenizer turns into tokens, read in batches.

A source is one of (local files only):

- `.txt`: UTF-8 text; documents are its blocks of lines separated by blank lines (lines of
  nothing but whitespace); a document is its lines joined by "\\n". Text whose documents
  hold blank lines (code, long articles) belongs in one of the formats below, one
  document per record.
- `.jsonl`: one JSON object per line (blank lines skipped); its `field` (default "text")
  is the document.
- `.parquet`: a Parquet file (pip install mxgraph[data]); the string column `field`.
- a directory written by Hugging Face `datasets`' `Dataset.save_to_disk`: `state.json`
  lists its Arrow files (IPC stream format) in order; the string column `field`. Read with
  pyarrow; `datasets` itself is not needed. A `DatasetDict`'s directory holds one such
  directory per split: pass that one (e.g. DIR/train).

`read_documents` yields `(texts, done)`: a batch of documents in source order and the
progress it makes, in the unit and out of the total `progress_total` gives (bytes for
text and JSONL, rows for Parquet and Arrow). Every error is a `DataError` naming the file
(and line or row) and the fix.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from mxgraph.errors import DataError, UserError

DATA_INSTALL_HINT = "pip install mxgraph[data]"
DOCUMENT_FORMATS = ("a .txt file (documents separated by blank lines), a .jsonl file (a "
                    "JSON object per line), a .parquet file, or a directory saved by "
                    "datasets' save_to_disk")
DOCUMENT_KINDS = ("txt", "jsonl", "parquet", "arrow_dir")


def document_kind(source: str) -> str | None:
    """"txt", "jsonl", "parquet" or "arrow_dir" (a `save_to_disk` directory) for a source of
    documents, None for anything else (a .npy, another file, a missing path)."""
    path = Path(source)
    if path.is_dir():
        return "arrow_dir" if (path / "state.json").is_file() or \
            (path / "dataset_dict.json").is_file() else None
    suffix = path.suffix.lower()
    return {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix)


def check_documents(source: str, field: str) -> str:
    """The kind of document source `source` is (`document_kind`), after the checks that
    need no full read: it exists and is readable, a Parquet file or Arrow directory has a
    string column `field`. DataError otherwise."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"data {source} does not exist; with a tokenizer --data takes "
                        f"{DOCUMENT_FORMATS}")
    kind = document_kind(source)
    if kind is None:
        what = "directory is not one saved by datasets' save_to_disk (no state.json)" \
            if path.is_dir() else f"file type {path.suffix or '(none)'} is not supported"
        raise DataError(f"data {source}: {what}; with a tokenizer --data takes "
                        f"{DOCUMENT_FORMATS} (or a .npy of token ids)")
    if kind == "arrow_dir":
        arrow_files(path)  # a DatasetDict, a missing file
    elif not os.access(path, os.R_OK):
        raise DataError(f"data file {source} is not readable (permissions); make it readable "
                        f"or pass another file")
    if kind in ("parquet", "arrow_dir"):
        _string_column(_schema(path, kind), field, source)
    return kind


def data_files(source: str) -> list[Path]:
    """The files whose contents make `source`'s documents (for a fingerprint)."""
    path = Path(source)
    if document_kind(source) == "arrow_dir":
        return [path / "state.json", *arrow_files(path)]
    return [path]


def progress_total(source: str, kind: str) -> int:
    """The total of `read_documents`' progress: bytes (txt, jsonl) or rows."""
    path = Path(source)
    if kind in ("txt", "jsonl"):
        return path.stat().st_size
    if kind == "parquet":
        return _parquet(path).metadata.num_rows
    return sum(_arrow_table(file).num_rows for file in arrow_files(path))


def read_documents(source: str, kind: str, field: str, batch_size: int = 1024,
                   batch_chars: int = 1 << 20) -> Iterator[tuple[list[str], int]]:
    """Batches of `source`'s documents with the progress each makes: a batch ends after
    `batch_size` documents or once it holds `batch_chars` characters (what the tokenizer
    holds at once grows with the text: about 150 bytes a token)."""
    path = Path(source)
    if kind == "txt":
        rows = _text_blocks(path)
    elif kind == "jsonl":
        rows = _jsonl_fields(path, field)
    elif kind == "parquet":
        rows = _column_rows(((batch, source) for batch in _parquet(path).iter_batches(
            batch_size=batch_size, columns=[field])), field)
    else:
        rows = _column_rows(((batch, str(file)) for file in arrow_files(path)
                             for batch in _arrow_table(file).select([field]).to_batches(
                                 max_chunksize=batch_size)), field)
    yield from _batched(rows, batch_size, batch_chars)


def _column_rows(batches, field: str) -> Iterator[tuple[str, int]]:
    """(text, 1) per row of Arrow record batches (column 0, from the named file)."""
    for batch, source in batches:
        for text in _strings(batch.column(0), source, field):
            yield text, 1


def _batched(items: Iterator[tuple[str | None, int]], size: int, chars: int
             ) -> Iterator[tuple[list[str], int]]:
    """Batches of the texts of `items` (text or None for progress alone, progress)."""
    texts, held, done = [], 0, 0
    for text, advance in items:
        if text is not None:
            texts.append(text)
            held += len(text)
        done += advance
        if len(texts) == size or held >= chars:
            yield texts, done
            texts, held, done = [], 0, 0
    if texts or done:
        yield texts, done


def _text_blocks(path: Path) -> Iterator[tuple[str | None, int]]:
    """(document, bytes read for it) per blank-line-separated block of a text file; the
    blank lines after the last block come as (None, their bytes)."""
    lines, read = [], 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            read += len(raw)
            line = _decode(raw, path, number).rstrip("\r\n")
            if line.strip():
                lines.append(line)
            elif lines:
                yield "\n".join(lines), read
                lines, read = [], 0
    if lines or read:
        yield ("\n".join(lines) if lines else None), read


def _jsonl_fields(path: Path, field: str) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, path, number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise DataError(f"{path} line {number} is not JSON ({error}); a .jsonl file "
                                f"holds one JSON object per line") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number} is a JSON {type(record).__name__}, not "
                                f"an object; a .jsonl file holds one object per line, e.g. "
                                f'{{"{field}": "..."}}')
            if field not in record:
                fields = ", ".join(record) or "none"
                raise DataError(f"{path} line {number} has no field {field!r} (its fields: "
                                f"{fields}); name the text field with --data-field NAME")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{path} line {number}: field {field!r} is "
                                f"{'null' if text is None else type(text).__name__}, not a "
                                f"string; fix the line or pick another --data-field")
            yield text, len(raw)


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} line {number} is not UTF-8 text ({error.reason} at byte "
                        f"{error.start} of the line); convert the file to UTF-8") from None


def _strings(column, source: str, field: str) -> list[str]:
    if column.null_count:
        raise DataError(f"{source}: column {field!r} has {column.null_count} null value(s) "
                        f"in a batch; drop or fill them, or pick another --data-field")
    return column.to_pylist()


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError(f"reading .parquet files and datasets directories needs pyarrow: "
                        f"{DATA_INSTALL_HINT}") from None
    return pyarrow


def _parquet(path: Path):
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None


def arrow_files(directory: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` directory, in the order its state.json lists."""
    if (directory / "dataset_dict.json").is_file():
        try:
            splits = json.loads((directory / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = []
        raise DataError(f"data {directory} is a DatasetDict (splits: {', '.join(splits)}); "
                        f"pass one split's directory, e.g. --data {directory / 'train'}")
    try:
        state = json.loads((directory / "state.json").read_text())
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{directory}/state.json does not list the data files ({error!r}); "
                        f"save the dataset again with save_to_disk") from None
    missing = [str(file) for file in files if not file.is_file()]
    if missing or not files:
        raise DataError(f"{directory}: data file {missing[0] if missing else '(none)'} listed in "
                        f"state.json is missing; save the dataset again with save_to_disk")
    return files


def _arrow_table(file: Path):
    """The Arrow file's table, memory-mapped (no copy)."""
    pa = _pyarrow()
    try:
        return pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{file}: not an Arrow stream as save_to_disk writes ({error})") from None


def _schema(path: Path, kind: str):
    if kind == "parquet":
        return _parquet(path).schema_arrow
    pa = _pyarrow()
    file = arrow_files(path)[0]
    try:
        return pa.ipc.open_stream(pa.memory_map(str(file))).schema
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{file}: not an Arrow stream as save_to_disk writes ({error})") from None


def _string_column(schema, field: str, source: str) -> None:
    pa = _pyarrow()
    if field not in schema.names:
        raise DataError(f"data {source} has no column {field!r} (its columns: "
                        f"{', '.join(schema.names)}); name the text column with --data-field NAME")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"data {source}: column {field!r} holds {kind}, not text; name the text "
                        f"column with --data-field NAME")
