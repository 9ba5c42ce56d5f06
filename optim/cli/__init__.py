"""The ``sparsecomm`` command line (entry point: :func:`optim.cli.main.main`)."""
