"""``python -m duoserve``: the same as the ``duoserve`` command."""

import sys

from duoserve.cli import main

sys.exit(main())
