"""``python -m cupy_comba.cli`` runs the ``cupy-comba`` command."""

from . import main

main(prog_name="cupy-comba")
