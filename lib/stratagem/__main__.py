"""``python -m stratagem``: the ``stratagem`` command."""

from stratagem.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
