"""`python -m verl_moe.tools.align ...`: the same options as `verl-moe align` (an entry point:
nothing imports it, so it may sit on top of the command line)."""

import sys

from ..cli import app

app(args=["align", *sys.argv[1:]], prog_name="python -m verl_moe.tools.align")
