"""``python -m stoa.bench.pulse``: the same benchmark and flags as ``stoa bench pulse``."""

import argparse
import sys

from stoa.bench.pulse import __doc__ as DESCRIPTION
from stoa.bench.pulse import add_arguments, main

parser = argparse.ArgumentParser(prog="stoa bench pulse", description=(DESCRIPTION or "").strip())
add_arguments(parser)
sys.exit(main(parser.parse_args()))
