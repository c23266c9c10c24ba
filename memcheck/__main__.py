"""``python -m memcheck``: the same as the ``memcheck`` command."""

from memcheck.cli import main

main()
