"""``python -m cosyvoice_fast ...``: the subcommands live in :mod:`cosyvoice_fast.cli.main`."""

from cosyvoice_fast.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
