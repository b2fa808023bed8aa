"""The ``stratagem`` command: ``stratagem demo``, ``stratagem env``, ``stratagem checkpoint PATH``.

Also runs as ``python -m stratagem``. `stratagem.cli.classifier` is the demo's
training function, written as a user of the library would write it.
"""

from stratagem.cli.main import main as main

__all__ = ["main"]
