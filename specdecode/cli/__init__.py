"""The command line, one module per subcommand plus the options they share (options.py)."""

from specdecode.cli.main import main

__all__ = ["main"]
