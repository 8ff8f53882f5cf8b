"""NOTE: [Grad-mode regions] in ir/capture.py: forward code under torch.no_grad() that no parameter
reaches (a rotary embedding's, as transformers 5.17 writes it) is captured inline and trains as
eager does; one a parameter reaches is refused, since inlined it would pass gradients eager stops."""

import pytest
import torch
from torch import nn

from lazytrain.errors import TraceError
from lazytrain.ir.capture import capture

from checks import replay_equals_eager
from models import model_pair, token_batch


class Rotary(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    @torch.no_grad()
    def forward(self, positions):
        angles = positions[..., None].float() * self.inv_freq
        return torch.cat([angles, angles], -1).cos()


class Tiny(nn.Module):
    def __init__(self, vocab=32, dim=16, detach_weights=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.detach_weights = detach_weights

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        x = self.proj(x * self.rotary(positions))
        if self.detach_weights:
            with torch.no_grad():
                x = x * x.mean()  # a parameter reaches this region
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_no_grad_rotary_trains_as_eager():
    meta, real = model_pair(Tiny)
    batch = token_batch(2, 8, 32)
    graph = capture(meta, batch)
    assert not any("wrap_with" in str(n.target) for n in graph.nodes)
    replay_equals_eager(meta, real, batch, budget=1 << 30)


def test_no_grad_region_over_parameters_is_refused():
    meta, _ = model_pair(lambda: Tiny(detach_weights=True))
    with pytest.raises(TraceError, match=r"torch.no_grad\(\).*\.detach\(\)"):
        capture(meta, token_batch(2, 8, 32))
