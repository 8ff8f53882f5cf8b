"""Analyses the passes read, not stages of the pipeline themselves: what autograd saves (`saved`),
what a stage's backward holds (`backward`), operators' own workspace (`memory`), what a recompute
may skip (`remat`) and which operators keep a chunked stage's split positions apart (`chunk_rules`).
"""
