"""metrale_ple: Python bindings of the metrale-ple PLE runtime.

PLE sites ("per-layer embeddings", n-gram flavour) hash the n-grams ending at
each new token into rows of a very large table, turn the rows into a gated
update and add it to the model's residual streams (the "highway"). This
package exposes the Rust runtime on the CPU backend:

- ``ids(tokens, *, vocab_size, eos, ngram_size, heads_per_ngram, vocab_base,
  ...)``: the id hash with derived constants (as ``metrale-ple ids``);
- ``token_map(tokenizer_json)``: Engram's compressed-token map built from a
  tokenizer.json (as ``metrale-ple token-map``);
- ``init_checkpoint(path, ...)`` and ``Checkpoint.open(path)``: synthetic
  and real checkpoints, their geometry and sites (``Site.ids``);
- ``Layer`` and ``Carry``: one site's forward over a numpy float32 highway
  (or a CPU torch tensor), updated in place, with per-sequence carries
  (``snapshot``/``restore``/``reset``/``release``, context managers);
- ``Layer.plan(work)`` hashes a step once into a ``Plan`` (ids, distinct
  ids, slots) and ``Layer.stage(plan)`` returns its rows: all an engine
  that runs its own kernels needs of the layer;
- ``Engine``: sequences over every site with the prefix cache, preemption,
  swaps and speculative verify/commit;
- ``Server`` and ``serve``: the serving loop over a fixed workload;
- ``shard_checkpoint`` and ``TensorParallelEngine``: tensor-parallel ranks'
  shares of a checkpoint (each rank's columns of every table row) and
  sequences over them, every rank in this process or one rank whose
  projections a ``reduce`` callable completes;
- ``metrale_ple.torch.PleEmbedding``: an ``nn.Module`` for one PLE site
  (torch is optional and imported only there);
- ``metrale_ple.transformers``: ``patch(model, checkpoint_dir, table=...)``
  runs a transformers Qwen4-Exp model's PLE sites on this runtime, and
  ``from_pretrained(checkpoint_dir, table="cached")`` loads one without its
  PLE tables in memory (torch and transformers imported only there).

Errors: ``ValueError`` for bad arguments and malformed blobs, files or
configs; ``OSError`` (``FileNotFoundError``, ...) for I/O failures. Every
object may be shared between Python threads; calls release the GIL.
"""

from ._metrale_ple import (
    Carry,
    Checkpoint,
    Engine,
    Ids,
    Layer,
    Plan,
    Server,
    Site,
    TensorParallelEngine,
    __version__,
    _rust_decode_timing,
    ids,
    init_checkpoint,
    serve,
    shard_checkpoint,
    token_map,
)

__all__ = [
    "Carry",
    "Checkpoint",
    "Engine",
    "Ids",
    "Layer",
    "Plan",
    "Server",
    "Site",
    "TensorParallelEngine",
    "__version__",
    "ids",
    "init_checkpoint",
    "serve",
    "shard_checkpoint",
    "token_map",
]
