"""The solver: the MIP that places every stage (weights, internals, outputs, optimizer step), its
cost terms, and the solve with its cache.

`solve.py` is pass `solve` of the pipeline (`solver.solve.solve`): it solves the MIP, falls back to
fixed policies, and finds the smallest feasible budget; `formulation.py` builds the MIP (its
binaries, the windows priced and bounded) and reads a plan back. `step_model.py` writes one training step's memory, transfers, host work and collectives
per window over the MIP's binaries, with `steps/` (one rule per kind of optimizer step, which pass
`lower` also calls for the kind's buffers and events), `disk_model.py` (the disk tier), `backlog.py`
(the host worker's and the disk's queues) and `shards.py` (sharded data-parallel state). `footprint.py` is
the cost model of a placement, bytes and seconds per stage, that `solve` and pass `lower` both price
with, so that `verify` re-checks event by event the memory `solve` counted. `reserve.py` sizes the allocator's
room under the budget for the step's largest allocation. `cuts.py` adds valid
rows that change no plan's value, `refusal.py` words a refusal past the device, `milp.py` hands the model to HiGHS or CBC, and `plancache.py`
keeps finished plans on disk.
"""
