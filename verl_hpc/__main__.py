"""`python -m verl_hpc ...` is the same as `verl-hpc ...`."""

import sys

from verl_hpc.cli.main import main

sys.exit(main())
