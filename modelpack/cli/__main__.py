"""``python -m modelpack.cli``: the ``modelpack`` command without its console script."""

from modelpack.cli import main

main(prog_name="modelpack")
