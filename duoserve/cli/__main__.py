"""``python -m duoserve.cli``: the same as the ``duoserve`` command."""

import sys

from duoserve.cli import main

sys.exit(main())
