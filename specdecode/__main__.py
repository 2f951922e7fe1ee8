"""`python -m specdecode ...`: the `specdecode` command, the form torchrun's `-m` takes
(`torchrun --nproc-per-node N -m specdecode train KIND ...`)."""

import sys

from specdecode.cli.main import main

sys.exit(main())
