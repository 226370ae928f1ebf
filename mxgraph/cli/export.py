"""`mxgraph export CHECKPOINT --hf OUT`: write a checkpoint of `mxgraph train` (any layout:
the shards are gathered) as a Hugging Face model directory.

    mxgraph export runs/checkpoints --hf exported/ --max-shard-size 2GB
"""
from __future__ import annotations


def add_export_parser(commands, parents) -> None:
    """Register `export` on the CLI's subparsers."""
    export = commands.add_parser("export", parents=parents,
                                 help="write a checkpoint of mxgraph train as a Hugging Face "
                                      "model directory (any layout: shards are gathered)")
    export.add_argument("checkpoint", help="a committed step directory, or a --checkpoint-dir "
                                           "(its newest committed step)")
    export.add_argument("--hf", required=True, metavar="OUT",
                        help="new or empty directory for config.json, the safetensors and "
                             "the tokenizer files of the model directory the run started from")
    export.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (bytes, or e.g. 5GB, 500MB); more "
                             "files come with model.safetensors.index.json")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(run=run_export)


def run_export(args) -> int:
    """Export the checkpoint; print how many files were written where."""
    from mxgraph.hf.export import export
    written = export(args.checkpoint, args.hf, args.max_shard_size, progress=not args.no_progress)
    print(f"wrote {len(written)} files to {args.hf}")
    return 0
