"""Generate tokens with a small PyTorch model whose layers call
``metrale_ple.torch.PleEmbedding`` at the checkpoint's PLE sites.

Needs torch (``pip install torch``) besides the metrale_ple package
(``pip install ./crates/python``). Both the model and the checkpoint (the
tiny preset, written on first use) have random weights, so the generated
tokens mean nothing: the example shows the wiring.

- The model is a stack of ``num_hidden_layers`` residual MLP blocks over a
  highway of ``hc_mult`` streams of ``hidden_size`` values; the block at
  model layer ``ple_layer_ids[s] - 1`` adds PLE site ``s`` (a per-sequence
  carry at each site holds the n-gram history and the conv state).
- The prompts share a system prompt: it is prefilled once, every site's
  carry is snapshotted, and each prompt restores those snapshots and
  prefills only its own tokens (prefix reuse).
- Then all prompts decode together, one batched ``PleEmbedding.decode``
  per site and step, sampling from the model's logits (seeded).

Usage: python examples/python/generate.py [--checkpoint DIR] [--tokens N]
"""

import argparse
import tempfile
import time
from pathlib import Path

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover
    raise SystemExit("this example needs torch: pip install torch") from e

import metrale_ple
from metrale_ple.torch import PleEmbedding


class Block(nn.Module):
    """A residual MLP over each highway stream, then (optionally) a PLE
    site."""

    def __init__(self, hidden: int, ple: PleEmbedding | None, site: int | None):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.ple = ple
        self.site = site

    def forward(self, x, tokens, carries, decode: bool):
        x = x + self.mlp(self.norm(x))
        if self.ple is None:
            return x
        c = carries[self.site]
        return self.ple.decode(x, tokens, c) if decode else self.ple(x, tokens, c)


class ToyLM(nn.Module):
    """Token embedding, blocks with PLE at the checkpoint's sites, a tied
    output head."""

    def __init__(self, ck: metrale_ple.Checkpoint, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        g = ck.geometry
        self.hc, self.hidden, vocab = g["hc_mult"], g["hidden_size"], g["vocab_size"]
        self.embed = nn.Embedding(vocab, self.hidden)
        at = {layer - 1: s for s, layer in enumerate(g["ple_layer_ids"])}
        self.ples = [PleEmbedding(ck, site=s, table="cached") for s in range(len(at))]
        self.blocks = nn.ModuleList(
            Block(self.hidden, self.ples[at[i]] if i in at else None, at.get(i))
            for i in range(g["num_hidden_layers"])
        )

    def new_carries(self):
        return [p.new_carry() for p in self.ples]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, carries, decode: bool = False) -> torch.Tensor:
        """tokens [T] of one sequence (carries: one per site), or with
        decode=True one token for each of B sequences (carries: per site a
        list of B). Returns logits [T or B, vocab]."""
        x = self.embed(tokens)[:, None, :].expand(-1, self.hc, -1).contiguous()
        for b in self.blocks:
            x = b(x, tokens, carries, decode)
        return x.mean(1) @ self.embed.weight.T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, help="a checkpoint directory (default: a new tiny one)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to generate per prompt")
    a = ap.parse_args()

    tmp = None
    if a.checkpoint is None:
        tmp = tempfile.TemporaryDirectory()
        a.checkpoint = Path(tmp.name) / "tiny"
        metrale_ple.init_checkpoint(a.checkpoint, preset="tiny", seed=1)
        print(f"wrote a tiny checkpoint (random weights) to {a.checkpoint}")
    ck = metrale_ple.Checkpoint.open(a.checkpoint)
    g = ck.geometry
    model = ToyLM(ck)
    print(f"model: {g['num_hidden_layers']} blocks, PLE at layers {[l - 1 for l in g['ple_layer_ids']]}, "
          f"highway {g['hc_mult']} x {g['hidden_size']}")

    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, g["vocab_size"], (96,), generator=gen)
    prompts = [torch.randint(0, g["vocab_size"], (n,), generator=gen) for n in (12, 30, 7, 21)]

    # The shared system prompt once; its carries are kept as snapshots.
    t0 = time.perf_counter()
    sys_carries = model.new_carries()
    model(system, sys_carries)
    sys_blobs = [c.snapshot() for c in sys_carries]
    for c in sys_carries:
        c.release()

    # Each prompt restores the system prompt's carries and prefills its own
    # tokens only.
    seqs = []
    next_tok = []
    for p in prompts:
        carries = model.new_carries()
        for c, blob in zip(carries, sys_blobs):
            c.restore(blob)
        logits = model(p, carries)
        seqs.append(carries)
        next_tok.append(int(logits[-1].argmax()))
    prefill_s = time.perf_counter() - t0
    reused = len(system) * (len(prompts) - 1)

    # Batched decode over every prompt at once, sampling (seeded).
    t0 = time.perf_counter()
    out = [[t] for t in next_tok]
    sampler = torch.Generator().manual_seed(1)
    for _ in range(a.tokens - 1):
        toks = torch.tensor([o[-1] for o in out])
        per_site = [[s[i] for s in seqs] for i in range(len(model.ples))]
        logits = model(toks, per_site, decode=True)
        probs = torch.softmax(logits / logits.std(1, keepdim=True), 1)
        for o, t in zip(out, torch.multinomial(probs, 1, generator=sampler)[:, 0].tolist()):
            o.append(int(t))
    decode_s = time.perf_counter() - t0

    for i, (p, o) in enumerate(zip(prompts, out)):
        print(f"prompt {i} ({len(system)} + {len(p)} tokens) -> {o}")
    print(f"prefill {prefill_s * 1e3:.1f} ms ({reused} system-prompt tokens reused from snapshots), "
          f"decode {decode_s * 1e3:.1f} ms for {len(prompts)} x {a.tokens} tokens")
    for carries in seqs:
        for c in carries:
            c.release()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
