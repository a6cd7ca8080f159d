"""``python -m redbatch.cli``: the same as the ``redbatch`` command."""

from redbatch.cli import main

main()
