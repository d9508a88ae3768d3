"""The ``dynatrain`` console script (``dynatrain.cli:main``): one module per subcommand.

Each command module parses its arguments and calls the library; :mod:`.app` wires them into one
parser. Nothing outside this package imports it (a test checks), so the command line stays a leaf
of the dependency graph.
"""

from dynatrain.cli.app import main

__all__ = ["main"]
