"""Typed stubs of the native module ``metrale_ple._metrale_ple``."""

import os
from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

__version__: str

Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
"""Token ids: a list/tuple of ints, a 1-D integer array or a tensor."""
Highway = Any
"""A C-contiguous, writeable float32 numpy array or CPU torch tensor of
``T`` rows of ``hc_mult * hidden_size`` values (``[T, C]`` or
``[T, hc_mult, hidden_size]``), updated in place."""
Mask = Sequence[bool] | npt.NDArray[np.bool_]
"""A token mask: one bool per token (per sequence in a decode batch),
``True`` where masked (DeepSeek-V4.1's ``token_mask`` with the opposite
polarity); taken by DeepSeek-V4.1 Engram sites only."""

class Ids:
    """Row ids of hashed tokens and the site's hash constants."""

    @property
    def ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def multipliers(self) -> list[int]: ...
    @property
    def head_vocab_sizes(self) -> list[int]: ...
    @property
    def head_offsets(self) -> list[int]: ...
    @property
    def padded_rows(self) -> int: ...
    @property
    def history(self) -> list[int]: ...

def ids(
    tokens: Tokens,
    *,
    vocab_size: int,
    eos: int,
    ngram_size: int,
    heads_per_ngram: int,
    vocab_base: int,
    divisible_by: int = 128,
    seed: int = 1234,
    site: int = 0,
    history: Tokens | None = None,
) -> Ids: ...
def token_map(tokenizer: str | os.PathLike[str]) -> list[int]: ...
def init_checkpoint(
    path: str | os.PathLike[str],
    preset: str = "tiny",
    table_rows: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
) -> Checkpoint: ...

class Site:
    """One PLE site of a checkpoint."""

    @property
    def index(self) -> int: ...
    @property
    def layer(self) -> int: ...
    @property
    def padded_rows(self) -> int: ...
    @property
    def stored_rows(self) -> int: ...
    @property
    def multipliers(self) -> list[int]: ...
    @property
    def head_vocab_sizes(self) -> list[int]: ...
    @property
    def head_offsets(self) -> list[int]: ...
    @property
    def ngram_heads(self) -> int: ...
    def ids(
        self,
        tokens: Tokens,
        history: Tokens | None = None,
        *,
        doc_starts: Sequence[int] | None = None,
        masked: Sequence[int] | None = None,
    ) -> Ids: ...

class Checkpoint:
    """A validated checkpoint directory."""

    @staticmethod
    def open(path: str | os.PathLike[str]) -> Checkpoint: ...
    @property
    def path(self) -> str: ...
    @property
    def sites(self) -> list[Site]: ...
    @property
    def geometry(self) -> dict[str, Any]: ...
    def layer(
        self, site: int = 0, *, table: str = "cached", max_tokens: int = 256, slots: int = 65536
    ) -> Layer: ...

class Carry:
    """One sequence's carry at one layer (a context manager)."""

    def snapshot(self) -> bytes: ...
    def restore(self, blob: bytes | bytearray) -> None: ...
    def reset(self) -> None: ...
    def release(self) -> None: ...
    @property
    def history(self) -> list[int]: ...
    @property
    def released(self) -> bool: ...
    def __enter__(self) -> Carry: ...
    def __exit__(self, *exc: object) -> bool: ...

class Plan:
    """A step hashed once by ``Layer.plan``."""

    @property
    def ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def distinct(self) -> npt.NDArray[np.uint64]: ...
    @property
    def slots(self) -> npt.NDArray[np.int64]: ...
    def seq_ids(self, i: int) -> npt.NDArray[np.uint64]: ...
    def __len__(self) -> int: ...

class Layer:
    """One PLE site's layer."""

    def __init__(
        self,
        checkpoint: Checkpoint | str | os.PathLike[str],
        site: int = 0,
        *,
        table: str = "cached",
        max_tokens: int = 256,
        slots: int = 65536,
    ) -> None: ...
    @staticmethod
    def from_weights(
        *,
        hidden: int,
        hc_mult: int,
        head_dim: int,
        ngram_size: int,
        heads_per_ngram: int,
        multipliers: Sequence[int],
        head_vocab_sizes: Sequence[int],
        head_offsets: Sequence[int],
        eos: int,
        conv_kernel: int,
        dilation: int,
        eps: float,
        key_proj: npt.NDArray[np.uint16],
        value_proj: npt.NDArray[np.uint16],
        norm_key: npt.NDArray[np.float32],
        norm_query: npt.NDArray[np.float32],
        norm_conv: npt.NDArray[np.float32],
        conv1d: npt.NDArray[np.float32],
        table: npt.NDArray[np.uint16],
        max_tokens: int = 256,
        vocab_size: int | None = None,
    ) -> Layer: ...
    def new_carry(self) -> Carry: ...
    def prefill(
        self, carry: Carry, tokens: Tokens, hidden: Highway, *, mask: Mask | None = None
    ) -> None: ...
    def decode(
        self,
        carries: Sequence[Carry],
        tokens: Tokens,
        hidden: Highway,
        *,
        mask: Mask | None = None,
    ) -> None: ...
    def plan(self, work: Sequence[tuple[Tokens, Tokens]]) -> Plan: ...
    def prefetch(self, plan: Plan) -> None: ...
    def stage(self, plan: Plan) -> npt.NDArray[np.float32]: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def hc_mult(self) -> int: ...
    @property
    def channels(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def context_len(self) -> int: ...
    @property
    def eos(self) -> int: ...
    @property
    def aux_blob_bytes(self) -> int: ...
    @property
    def state_len(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ngram_heads(self) -> int: ...

class Engine:
    """Sequences over every PLE site of a checkpoint (a context manager)."""

    def __init__(
        self,
        checkpoint: Checkpoint | str | os.PathLike[str],
        *,
        table: str = "cached",
        block_size: int = 64,
        prefix_cache_mib: int = 64,
        resident_carries: int = 32,
        prefill_chunk: int = 128,
        max_batch: int = 64,
        slots: int = 65536,
        preempt_to: str = "host",
        swap_dir: str | os.PathLike[str] | None = None,
        remote: str | None = None,
        remote_timeout_ms: int = 250,
        remote_fallback: bool = False,
    ) -> None: ...
    def add_sequence(self, prompt: Tokens, *, mask: Mask | None = None) -> tuple[int, int]: ...
    def prefill(
        self, seq_id: int, tokens: Tokens, hidden: Highway, *, mask: Mask | None = None
    ) -> None: ...
    def decode(
        self, batch: Sequence[tuple[int, int]], hidden: Highway, *, mask: Mask | None = None
    ) -> None: ...
    def verify(self, seq_id: int, draft: Tokens, hidden: Highway) -> None: ...
    def commit(self, seq_id: int, accepted: int) -> None: ...
    def snapshot(self, seq_id: int) -> bytes: ...
    def add_from_snapshot(
        self, snapshot: bytes | bytearray, tokens: Tokens, *, mask: Mask | None = None
    ) -> int: ...
    def swap_out(self, seq_id: int, target: str = "host") -> None: ...
    def swap_in(self, seq_id: int) -> None: ...
    def release(self, seq_id: int) -> None: ...
    def prefetch(self, seq_id: int, tokens: Tokens) -> None: ...
    def tokens(self, seq_id: int) -> list[int]: ...
    def is_resident(self, seq_id: int) -> bool: ...
    def sequence_ids(self) -> list[int]: ...
    def clear_prefix_cache(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def width(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def hc_mult(self) -> int: ...
    @property
    def carry_bytes(self) -> int: ...
    @property
    def batch_capacity(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc: object) -> bool: ...

Request = dict[str, Any] | tuple[Tokens, Tokens]
"""``{"prompt": ..., "generate": ...}``, ``(prompt, generate)`` or
``{"tokens": ..., "segments": [("prefill" | "decode", end), ...]}``."""

class Server:
    """The serving loop over an engine (a context manager)."""

    def __init__(
        self,
        checkpoint: Checkpoint | str | os.PathLike[str],
        *,
        table: str = "cached",
        block_size: int = 64,
        prefix_cache_mib: int = 64,
        resident_carries: int = 32,
        slots: int = 65536,
        in_flight: int = 48,
        prefill_chunk: int = 128,
        decode_batch: int = 16,
        prefetch: bool = True,
        retries: int | None = None,
        remote: str | None = None,
        remote_timeout_ms: int = 250,
        remote_fallback: bool = False,
    ) -> None: ...
    def run(
        self,
        requests: Sequence[Request],
        *,
        rows: Callable[[int], Sequence[float]] | None = None,
    ) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Server: ...
    def __exit__(self, *exc: object) -> bool: ...

def serve(
    checkpoint: Checkpoint | str | os.PathLike[str],
    requests: Sequence[Request],
    *,
    rows: Callable[[int], Sequence[float]] | None = None,
    **kwargs: Any,
) -> dict[str, Any]: ...
def shard_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    ranks: int,
    rank: int | None = None,
) -> list[str]: ...

class TensorParallelEngine:
    def __init__(
        self,
        rank_dirs: Sequence[str | os.PathLike[str]],
        *,
        reduce: Callable[[npt.NDArray[np.float32]], None] | None = None,
        table: str = "cached",
        block_size: int = 64,
        prefix_cache_mib: int = 64,
        resident_carries: int = 32,
        prefill_chunk: int = 128,
        max_batch: int = 64,
        slots: int = 65536,
    ) -> None: ...
    def add_sequence(self, prompt: Tokens) -> tuple[int, int]: ...
    def prefill(self, seq_id: int, tokens: Tokens, hidden: Highway) -> None: ...
    def decode(self, batch: Sequence[tuple[int, int]], hidden: Highway) -> None: ...
    def snapshot(self, seq_id: int) -> bytes: ...
    def add_from_snapshot(self, snapshot: bytes, tokens: Tokens) -> int: ...
    def release(self, seq_id: int) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def ranks(self) -> int: ...
    @property
    def width(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> TensorParallelEngine: ...
    def __exit__(self, *exc: object) -> bool: ...

def _rust_decode_timing(
    engine: Engine, batch: Sequence[tuple[int, int]], steps: int, value: float = 0.5
) -> list[float]: ...
