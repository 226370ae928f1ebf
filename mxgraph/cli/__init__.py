"""The `mxgraph` command: one module per subcommand (`train` in `main.py` with the parser,
`search.py`, `inspect.py`, `data.py`, export in `main.py`).

The top of the application layer (hf -> data -> train -> cli): it may import every
application package, `models` and the compiler's public surface; nothing imports it.
"""
from mxgraph.cli.main import main

__all__ = ["main"]
