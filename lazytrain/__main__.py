"""`python -m lazytrain ...`, as the `lazytrain` command: what `torchrun -m lazytrain train ...` runs
on each rank (NOTE: [Launching] in train/distributed.py)."""

from lazytrain.cli import main
from lazytrain.train.distributed import leave

leave(main())
