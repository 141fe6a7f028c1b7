"""``python -m specops``: the same CLI as ``specops`` (DeepSpeed's launcher starts ranks with
``--module specops``)."""

import sys

from specops.cli.main import main

sys.exit(main())
