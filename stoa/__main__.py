"""``python -m stoa`` runs the command line."""

import sys

from stoa.cli import main

sys.exit(main())
