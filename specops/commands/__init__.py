"""The ``specops`` command groups, one module each; ``specops/cli.py`` assembles them into one parser."""
