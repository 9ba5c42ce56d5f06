"""The ``sparsecomm`` command line (entry point: :func:`optim.apps.cli.main.main`)."""
