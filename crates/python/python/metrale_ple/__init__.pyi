"""Typed stubs of the ``metrale_ple`` package."""

from ._metrale_ple import (
    Carry as Carry,
    Checkpoint as Checkpoint,
    Engine as Engine,
    Ids as Ids,
    Layer as Layer,
    Plan as Plan,
    Server as Server,
    Site as Site,
    TensorParallelEngine as TensorParallelEngine,
    __version__ as __version__,
    _rust_decode_timing as _rust_decode_timing,
    ids as ids,
    init_checkpoint as init_checkpoint,
    serve as serve,
    shard_checkpoint as shard_checkpoint,
    token_map as token_map,
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
