"""PyTorch integration: ``PleEmbedding``, one PLE site as an ``nn.Module``.

torch is imported when this module is, never by ``import metrale_ple``.
The module is for inference: it runs the site's forward on the CPU backend
and returns ``hidden`` with the site's output added; no gradient flows
through the PLE update (it is added as a constant).

A model calls it in its forward at the layer of the site::

    ple = PleEmbedding(checkpoint, site=0, table="cached")
    carry = ple.new_carry()                    # one per sequence
    hidden = ple(hidden, tokens, carry)        # prefill: [T, C] or [T, hc, H]
    hidden = ple.decode(hidden, tokens, [c1, c2])  # one token per sequence
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ._metrale_ple import Carry, Checkpoint, Layer

__all__ = ["PleEmbedding"]


def _tokens(tokens) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


class PleEmbedding(nn.Module):
    """One PLE site of ``checkpoint`` (a ``Checkpoint`` or a path).

    ``forward(hidden, tokens, carry)`` runs ``tokens`` of one sequence (its
    carry advances) and returns ``hidden`` plus the site's output, a new
    float32 CPU tensor of the same shape: ``[T, C]``, ``[T, hc, H]`` or with
    a leading batch axis of 1. ``decode(hidden, tokens, carries)`` runs one
    token for each of ``len(carries)`` sequences, row ``b`` of ``hidden``
    for ``carries[b]``. Inputs on another device or dtype are copied to a
    float32 CPU tensor first and the result is moved back.
    """

    def __init__(
        self,
        checkpoint: Checkpoint | str,
        site: int = 0,
        *,
        table: str = "cached",
        max_tokens: int = 256,
        slots: int = 65536,
        layer: Layer | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer if layer is not None else Layer(
            checkpoint, site, table=table, max_tokens=max_tokens, slots=slots
        )
        self.site = site

    @property
    def channels(self) -> int:
        """Values per highway row (``hc_mult * hidden_size``)."""
        return self.layer.channels

    def new_carry(self) -> Carry:
        """A new per-sequence carry (release it, or use it as a context
        manager)."""
        return self.layer.new_carry()

    def _run(self, hidden: torch.Tensor, call) -> torch.Tensor:
        out = hidden.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()
        call(out)
        return out.to(device=hidden.device, dtype=hidden.dtype)

    def forward(self, hidden: torch.Tensor, tokens, carry: Carry) -> torch.Tensor:
        toks = _tokens(tokens)
        return self._run(hidden, lambda out: self.layer.prefill(carry, toks, out))

    def decode(self, hidden: torch.Tensor, tokens, carries: Sequence[Carry]) -> torch.Tensor:
        toks = _tokens(tokens)
        return self._run(hidden, lambda out: self.layer.decode(list(carries), toks, out))

    def extra_repr(self) -> str:
        return (
            f"site={self.site}, hidden_size={self.layer.hidden_size}, "
            f"hc_mult={self.layer.hc_mult}"
        )
