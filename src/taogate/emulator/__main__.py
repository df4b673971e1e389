"""``python -m taogate.emulator --port P ...``: the ``taogate emulate`` command, standalone."""

import typer

from taogate.emulator.cli import emulate

if __name__ == "__main__":
    typer.run(emulate)
