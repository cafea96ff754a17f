"""``python -m tessera``: the same as the ``tessera`` command."""

from tessera.cli import main

main()
