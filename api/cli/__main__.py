"""``python -m pipesched.api.cli``: the ``pipesched`` command."""

from pipesched.api.cli import main

main()
