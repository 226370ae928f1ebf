"""`python -m mxgraph.cli`: the `mxgraph` command."""
import sys

from mxgraph.cli.main import main

sys.exit(main())
