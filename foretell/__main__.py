"""``python -m foretell``: the ``foretell`` command without its console script."""

import sys

from foretell.cli import main

sys.exit(main())
