"""`python -m cosyvoice_fast ...` subcommands."""
