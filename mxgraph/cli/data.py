"""`mxgraph data prepare`: tokenize a data source into its token file before training.

    mxgraph data prepare --data corpus.jsonl --tokenizer path/to/model

writes `corpus.jsonl.<key>.tokens.npy` beside the data (`mxgraph.token_file`), the file
`mxgraph train --data corpus.jsonl --tokenizer path/to/model` then reads without
tokenizing; train makes it itself when it is missing, so this only moves the work ahead
(e.g. before a multi-node job).
"""
from __future__ import annotations

from mxgraph.data.documents import DOCUMENT_FORMATS, check_documents
from mxgraph.data.token_file import ensure_token_file, load_tokenizer, open_tokens, token_file_path


def add_data_parser(commands, parents) -> None:
    """Register `data` (and its `prepare`) on the CLI's subparsers."""
    data = commands.add_parser("data", parents=parents, help="prepare training data: "
                               "tokenize documents once into a token file (data prepare)")
    actions = data.add_subparsers(dest="action", metavar="ACTION", required=True,
                                  parser_class=type(data), title="actions")
    prepare = actions.add_parser(
        "prepare", parents=parents, help="tokenize --data with --tokenizer into its token file",
        description="Tokenize the documents of --data with --tokenizer, each followed by the "
        "tokenizer's end-of-text token, into DATA.<key>.tokens.npy beside the data (key: the "
        "tokenizer's files, the data's size and modification time, --data-field); mxgraph "
        "train with the same --data, --tokenizer and --data-field reads it. An up-to-date "
        "token file is kept.")
    prepare.add_argument("--data", required=True, help=f"documents: {DOCUMENT_FORMATS}")
    prepare.add_argument("--tokenizer", required=True,
                         help="directory of a saved Hugging Face tokenizer (e.g. a model's)")
    prepare.add_argument("--data-field", default="text",
                         help="the field (.jsonl) or column (.parquet, datasets directory) "
                              "holding each document (default: text)")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.set_defaults(run=run_prepare)


def run_prepare(args) -> int:
    """Make (or find) the token file; print its path and size."""
    tokenizer = load_tokenizer(args.tokenizer)
    check_documents(args.data, args.data_field)
    made = not token_file_path(args.data, args.tokenizer, tokenizer, args.data_field).is_file()
    path = ensure_token_file(args.data, args.tokenizer, args.data_field,
                             progress=not args.no_progress, tokenizer=tokenizer)
    tokens = open_tokens(path)
    print(f"{path}: {len(tokens):,} tokens ({tokens.dtype}), "
          f"{'made' if made else 'already up to date'}")
    return 0

