"""Custom operators that models call in place of torch's own kernels.

documents.py: attention restricted to each document of a packed row (NOTE: [Document attention]).
tiled_mlp.py: a decoder layer's gated MLP in tiles of tokens, recomputed in backward (NOTE: [Tiled MLP]).
Modules here are imported by the runtime, so they import only torch at module level.
"""
