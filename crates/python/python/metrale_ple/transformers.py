"""transformers integration: run a loaded Qwen4-Exp model's PLE sites on
this runtime.

``patch(model, checkpoint_dir, *, table="cached", **options)`` replaces
every ``Qwen4ExpTextPLELayer`` of a loaded ``Qwen4ExpForCausalLM`` or
``Qwen4ExpForConditionalGeneration`` with a ``PatchedPle`` module: the
site's forward over the checkpoint's table served ``table`` =
``"resident"``, ``"mapped"``, ``"cached"`` (a row cache of ``slots`` rows
over the shard files) or ``"shared"``. ``options`` are ``max_tokens`` and
``slots`` (as ``Layer``). The model's own PLE weights are dropped: the
sites read theirs from ``checkpoint_dir`` (the directory the model was
loaded from).

``from_pretrained(checkpoint_dir, *, cls=None, table="cached", **options,
**kwargs)`` loads the model with its PLE modules never built (no table in
memory: with ``table="cached"`` it stays on disk behind the row cache) and
patches it.

Carries: each site keeps one carry per batch row. A forward whose cache
holds no token context for the site (a fresh ``DynamicCache``, or one after
``cache.reset()``) starts every row over; a later forward continues them
(chunked prefill, decode steps, a ``generate`` call that passes the
previous call's ``past_key_values``). The site also keeps the token
context in the cache (conv state 2, as transformers' own module does) and
checks it against its carries on every forward, so a cache that was
reordered, cropped or re-batched behind its back is refused with a
``RuntimeError`` rather than read wrong. Beam search (``num_beams > 1``)
and assisted decoding reorder and crop the cache; ``generate`` refuses
them with a ``ValueError`` on a patched model.

Padding: left padding on the first forward of a sequence is supported (the
padded positions get no PLE update, as in transformers); padding inside a
continued sequence is refused.

Inference only: no gradient flows through the PLE update.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch
from torch import nn

from ._metrale_ple import Checkpoint, Layer

__all__ = ["PatchedPle", "patch", "from_pretrained", "unpatched_generate"]

_TABLES = ("resident", "mapped", "cached", "shared")


def _modeling():
    from transformers.models.qwen4_exp import modeling_qwen4_exp

    return modeling_qwen4_exp


def _text_config(config):
    return getattr(config, "text_config", None) or config


class PatchedPle(nn.Module):
    """One PLE site of a Qwen4-Exp decoder layer on this runtime.

    ``forward(hidden_states, input_ids, cache, conv_mask=None)`` has the
    signature of ``Qwen4ExpTextPLELayer.forward`` and returns the site's
    output (the decoder layer adds it to ``hidden_states``), computed in
    float32 and returned in ``hidden_states``' dtype and device.
    """

    def __init__(self, layer: Layer, layer_idx: int, site: int, context_len: int, eos: int):
        super().__init__()
        self.layer = layer
        self.layer_idx = layer_idx
        self.site = site
        self.context_len = context_len
        self.eos = eos
        self.carries: list = []

    def extra_repr(self) -> str:
        return f"site={self.site}, layer_idx={self.layer_idx}, rows={len(self.carries)}"

    def reset(self) -> None:
        """Release every row's carry (the next forward starts over)."""
        for c in self.carries:
            c.release()
        self.carries = []

    def snapshot(self) -> list[bytes]:
        """The carry of every batch row, as blobs for ``restore``."""
        return [c.snapshot() for c in self.carries]

    def restore(self, blobs) -> None:
        """Restore every row's carry from ``snapshot``'s blobs (the batch
        size must match)."""
        if len(blobs) != len(self.carries):
            raise ValueError(f"{len(blobs)} blobs for {len(self.carries)} batch rows")
        for c, b in zip(self.carries, blobs):
            c.restore(b)

    def _fresh(self, rows: int) -> None:
        self.reset()
        self.carries = [self.layer.new_carry() for _ in range(rows)]

    def _store_context(self, cache, ids: torch.Tensor, had_context: bool) -> None:
        # As Qwen4ExpTextNGramEmbedding does: the last context_len ids
        # (EOS-padded on a short first chunk) in conv state 2.
        if not had_context and ids.shape[1] < self.context_len:
            ids = torch.nn.functional.pad(ids, (self.context_len - ids.shape[1], 0), value=self.eos)
        cache.update_conv_state(ids, self.layer_idx, state_idx=2, conv_kernel_size=self.context_len)

    def forward(self, hidden_states, input_ids, cache=None, conv_mask=None, **kwargs):
        if input_ids is None:
            raise ValueError("the patched PLE site needs the token ids (ple_input_ids)")
        ids = input_ids.detach().long().cpu()
        B, T = ids.shape
        ctx = cache.get_conv_state(self.layer_idx, state_idx=2) if cache is not None else None
        fresh = ctx is None
        if not fresh:
            if len(self.carries) != B:
                raise RuntimeError(
                    f"PLE site {self.site}: the cache continues {B} rows but the site carries "
                    f"{len(self.carries)}; start a new cache for a new batch"
                )
            want = ctx.detach().long().cpu().tolist()
            for b, c in enumerate(self.carries):
                if [int(t) for t in c.history] != want[b]:
                    raise RuntimeError(
                        f"PLE site {self.site}: the cache's token context of row {b} "
                        f"({want[b]}) is not the site's ({c.history}): the cache was "
                        "reordered or cropped (beam search, assisted decoding), which "
                        "the patched model does not support"
                    )
        mask = None
        if conv_mask is not None:
            mask = conv_mask.detach().cpu().bool()
            if bool(mask.all()):
                mask = None
            elif not fresh:
                raise ValueError(
                    "the patched PLE site supports left padding on a sequence's first "
                    "forward only; this forward continues a cache with padded positions"
                )
        if fresh:
            self._fresh(B)
        if cache is not None:
            self._store_context(cache, ids, not fresh)
        x = hidden_states.detach()
        out = x.to(device="cpu", dtype=torch.float32).contiguous().clone()
        ref = out.clone()
        toks = ids.tolist()
        try:
            if T == 1 and not fresh:
                self.layer.decode(self.carries, [r[0] for r in toks], out.view(B, -1))
            else:
                for b in range(B):
                    start = 0
                    if mask is not None:
                        m = mask[b]
                        start = T - int(m.sum())
                        if bool(m[:start].any()) or not bool(m[start:].all()):
                            raise ValueError(
                                "the patched PLE site supports left padding only "
                                f"(row {b}'s attention mask is {m.int().tolist()})"
                            )
                    if start < T:
                        self.layer.prefill(self.carries[b], toks[b][start:], out[b, start:])
        finally:
            if cache is None:
                self.reset()
        delta = out - ref
        return delta.to(device=hidden_states.device, dtype=hidden_states.dtype)


def _check_config(cfg, ck) -> None:
    """Refuse a checkpoint whose PLE geometry or hash is not the model's."""
    geo = ck.geometry
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    pairs = {
        "vocab_size": (cfg.vocab_size, "vocab_size"),
        "hidden_size": (cfg.hidden_size, "hidden_size"),
        "hc_count": (cfg.hc_count, "hc_mult"),
        "eos_token_id": (eos, "eos_token_id"),
        "ngram_size": (cfg.ngram_size, "ngram_size"),
        "heads_per_ngram": (cfg.heads_per_ngram, "heads_per_ngram"),
        "ngram_vocab_size_base": (cfg.ngram_vocab_size_base, "ngram_vocab_size_base"),
        "make_ngram_vocab_size_divisible_by": (cfg.make_ngram_vocab_size_divisible_by, "divisible_by"),
        "seed": (cfg.seed, "hash_seed"),
        "ple_conv_kernel_size": (cfg.ple_conv_kernel_size, "conv_kernel_size"),
        "ple_layer_ids": (sorted(cfg.ple_layer_ids), "ple_layer_ids"),
        "rms_norm_eps": (cfg.rms_norm_eps, "rms_norm_eps"),
    }
    bad = [
        f"{k} {mine!r} vs {geo[theirs]!r}"
        for k, (mine, theirs) in pairs.items()
        if geo.get(theirs) != mine
    ]
    if bad:
        raise ValueError(
            f"{ck.path}: the checkpoint's PLE config is not the model's (model vs checkpoint: "
            + "; ".join(bad)
            + ")"
        )


def _sites(model):
    """(decoder layer, layer index) of every PLE site of ``model``."""
    found = []
    for name, mod in model.named_modules():
        if name.endswith(".layers") and isinstance(mod, nn.ModuleList):
            for i, layer in enumerate(mod):
                if getattr(layer, "ple", None) is not None:
                    found.append((layer, i))
    return found


def patch(model, checkpoint_dir: str | os.PathLike[str], *, table: str = "cached", **options: Any):
    """Replace every ``Qwen4ExpTextPLELayer`` of ``model`` (a loaded
    ``Qwen4ExpForCausalLM`` or ``Qwen4ExpForConditionalGeneration``) with a
    ``PatchedPle`` over ``checkpoint_dir``'s table served ``table``;
    ``options``: ``max_tokens`` (default 256), ``slots`` (default 65536).
    Returns ``model`` (patched in place). ``model.generate`` is wrapped to
    refuse beam search and assisted decoding."""
    if table not in _TABLES:
        raise ValueError(f"table must be one of {_TABLES}, got {table!r}")
    unknown = set(options) - {"max_tokens", "slots"}
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}: max_tokens and slots are accepted")
    ck = checkpoint_dir if isinstance(checkpoint_dir, Checkpoint) else Checkpoint.open(checkpoint_dir)
    _check_config(_text_config(model.config), ck)
    by_layer = {s.layer: s.index for s in ck.sites}
    sites = _sites(model)
    if not sites:
        raise ValueError("the model has no PLE site (no decoder layer with a .ple module)")
    got = sorted(i for _, i in sites)
    if got != sorted(by_layer):
        raise ValueError(
            f"the model's PLE layers {got} are not the checkpoint's {sorted(by_layer)}"
        )
    for dec, i in sites:
        site = by_layer[i]
        layer = ck.layer(site, table=table, **options)
        old = dec.ple
        dec.ple = PatchedPle(layer, i, site, layer.context_len, layer.eos)
        del old
    _guard_generate(model)
    return model


def _guard_generate(model) -> None:
    if getattr(model, "_metrale_ple_guarded", False):
        return
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        gc = kwargs.get("generation_config") or model.generation_config
        beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1
        if beams > 1:
            raise ValueError(
                "beam search (num_beams > 1) reorders the cache between steps, which the "
                "patched PLE sites do not follow; use greedy or sampling generation"
            )
        for k in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
            if kwargs.get(k) is not None or getattr(gc, k, None) is not None:
                raise ValueError(
                    f"assisted decoding ({k}) crops the cache, which the patched PLE sites "
                    "do not follow"
                )
        return original(*args, **kwargs)

    model.generate = generate
    model._metrale_ple_guarded = True
    model._metrale_ple_generate = original


def unpatched_generate(model):
    """The model's ``generate`` without the guard ``patch`` installs."""
    return getattr(model, "_metrale_ple_generate", model.generate)


class _Stub(nn.Module):
    """Stands in for ``Qwen4ExpTextPLELayer`` while the model is built by
    ``from_pretrained``: it has no parameters, so neither the table nor the
    site's dense weights are allocated or read."""

    def __init__(self, config, layer_idx, ple_layer_index):
        super().__init__()
        self.layer_idx = layer_idx
        # transformers' _init_weights zeroes `conv1d.weight` of every module
        # of the class it knows as Qwen4ExpTextPLELayer (this stub, while it
        # stands in): an empty, non-persistent buffer takes that.
        self.conv1d = nn.Module()
        self.conv1d.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, *a, **k):  # pragma: no cover - replaced before use
        raise RuntimeError("this PLE site was never patched")


@contextlib.contextmanager
def _without_ple(cls):
    mod = _modeling()
    saved = mod.Qwen4ExpTextPLELayer
    pattern = r".*\.ple\."
    owners = {cls, mod.Qwen4ExpPreTrainedModel}
    old_ignore = {c: c.__dict__.get("_keys_to_ignore_on_load_unexpected") for c in owners}
    mod.Qwen4ExpTextPLELayer = _Stub
    for c in owners:
        base = list(getattr(c, "_keys_to_ignore_on_load_unexpected", None) or [])
        c._keys_to_ignore_on_load_unexpected = base + [pattern]
    try:
        yield
    finally:
        mod.Qwen4ExpTextPLELayer = saved
        for c, v in old_ignore.items():
            if v is None:
                with contextlib.suppress(AttributeError):
                    delattr(c, "_keys_to_ignore_on_load_unexpected")
            else:
                c._keys_to_ignore_on_load_unexpected = v


def from_pretrained(
    checkpoint_dir: str | os.PathLike[str],
    *,
    cls=None,
    table: str = "cached",
    max_tokens: int = 256,
    slots: int = 65536,
    **kwargs: Any,
):
    """Load ``checkpoint_dir`` with transformers, its PLE modules never
    built (the table and the sites' weights are not read into memory), and
    patch it (``patch(model, checkpoint_dir, table=table, ...)``). ``cls``
    defaults to the class ``config.json``'s ``architectures`` names
    (``Qwen4ExpForCausalLM`` or ``Qwen4ExpForConditionalGeneration``);
    ``kwargs`` go to ``cls.from_pretrained``."""
    if cls is None:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(checkpoint_dir)
        archs = getattr(cfg, "architectures", None) or []
        names = [a for a in archs if a in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")]
        if not names:
            raise ValueError(
                f"{checkpoint_dir}: config.json names no Qwen4-Exp architecture ({archs}); pass cls="
            )
        cls = getattr(transformers, names[0])
    ck = Checkpoint.open(checkpoint_dir)  # validate before the (long) load
    with _without_ple(cls):
        model = cls.from_pretrained(checkpoint_dir, **kwargs)
    for dec, _ in _sites(model):
        if not isinstance(dec.ple, _Stub):  # pragma: no cover - defensive
            raise RuntimeError("the PLE modules were built despite the stub")
    return patch(model, ck, table=table, max_tokens=max_tokens, slots=slots)


def round_ple_to_bf16(model, *, seed: int) -> None:
    """Give every PLE site of ``model`` random norm and conv weights
    (transformers initialises them to zero, which would hide most of the
    site's arithmetic) and unit-scale random table rows, and round every PLE weight and table value to a
    bfloat16-representable value, kept in the model's dtype. The runtime
    projects with BF16 weights, so only bf16-representable weights make a
    float32 model and the runtime compute the same function; used by the
    tests, the benchmark and the example."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for dec, _ in _sites(model):
            p = dec.ple
            for norm in (p.norm_key, p.norm_query, p.norm_conv):
                norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.5)
            p.conv1d.weight.copy_(torch.randn(p.conv1d.weight.shape, generator=g) * 0.5)
            # Unit-scale table rows, so that the PLE update moves the logits.
            t = p.ple_embedding.ngram_embedding.weight
            t.copy_(torch.randn(t.shape, generator=g))
            for w in (
                p.key_proj.weight,
                p.value_proj.weight,
                p.ple_embedding.ngram_embedding.weight,
                p.norm_key.weight,
                p.norm_query.weight,
                p.norm_conv.weight,
                p.conv1d.weight,
            ):
                w.copy_(w.to(torch.bfloat16).to(w.dtype))
