"""The `mxgraph` command: one module per subcommand (`train.py`, `inspect.py`, `search.py`,
`export.py`, `data.py`), each registering itself with an `add_*_parser(commands, parents)`;
`main.py` holds what they share: the top-level parser, `main` and the one-line user errors.

The top of the application layer (hf -> data -> train -> cli): it may import every
application package, `models` and the compiler's public surface; nothing imports it.
"""
from mxgraph.cli.main import main

__all__ = ["main"]
