"""The ``specops`` command line: one module per command group, assembled into one parser by
:mod:`specops.cli.main` (the ``specops`` script's entry point); ``serve_runtime`` runs a replica
under uvicorn for ``specops serve``."""
