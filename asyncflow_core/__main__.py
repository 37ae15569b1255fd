"""``python -m asyncflow_core`` is the ``asyncflow`` command."""

from asyncflow_core.cli.main import main

main()
