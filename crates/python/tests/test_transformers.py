"""transformers 5.25 as the oracle: tiny random Qwen4-Exp models built and
saved by transformers, against this runtime (skipped without torch and
transformers; .ci/transformers installs them and fails when this file
skips).

Every model here has random PLE norm and conv weights (transformers
initialises them to zero) and every PLE weight and table value rounded to a
bfloat16-representable value, also in the float32 save: the runtime
projects with BF16 weights, so only then do both sides compute the same
function, and the comparisons hold to float32 accuracy.
"""

import copy
import os

import numpy as np
import pytest

if os.environ.get("METRALE_PLE_REQUIRE_TRANSFORMERS"):
    # .ci/transformers: a missing torch or transformers is a failure.
    import torch
    import transformers

    assert hasattr(transformers, "Qwen4ExpTextConfig"), f"transformers {transformers.__version__} has no Qwen4-Exp"
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen4-Exp", allow_module_level=True)

import metrale_ple  # noqa: E402
from metrale_ple import transformers as mtf  # noqa: E402

SEED = 99  # the hash seed: not the default 1234
EOS = 2
TEXT = dict(
    vocab_size=4096, hidden_size=64, hc_count=4, ngram_size=3, heads_per_ngram=2,
    ple_layer_ids=[2, 3], split_ngram_parts=2, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, hc_lowrank=16,
    ngram_vocab_size_base=50000, eos_token_id=EOS, seed=SEED, indexer_n_heads=2,
    indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8, indexer_compress_ratio=4,
)
# Float32 accuracy: both sides compute the same function on the same
# (bf16-representable) weights in float32, in a different order.
RTOL, ATOL = 1e-4, 1e-5
# Logits of these models are below 0.5 in magnitude (PLE moves them by
# ~0.4); patched and unpatched agree to ~5e-8.


def build(path, dtype, *, multimodal=False, seed=0):
    torch.manual_seed(seed)
    if multimodal:
        cfg = transformers.Qwen4ExpConfig(
            text_config=TEXT,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                               patch_size=4, out_hidden_size=64, num_position_embeddings=16),
            image_token_id=4000, video_token_id=4001, vision_start_token_id=4002,
            vision_end_token_id=4003,
        )
        model = transformers.Qwen4ExpForConditionalGeneration(cfg)
    else:
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**TEXT))
    mtf.round_ple_to_bf16(model, seed=seed + 1)
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def saved(request, tmp_path_factory):
    """(dir, model loaded back in float32) for a float32 and a bfloat16
    save."""
    dtype = getattr(torch, request.param)
    d = build(tmp_path_factory.mktemp(f"q4e-{request.param}"), dtype)
    # The bf16 save's weights are exact in float32: the oracle runs in
    # float32 on the very values the runtime reads.
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, model


def ple_modules(model):
    return [(i, layer.ple) for i, layer in enumerate(model.model.layers) if layer.ple is not None]


def new_cache(model):
    return transformers.DynamicCache(config=model.config)


# Two rows; EOS inside both, and a new sequence after the EOS.
ROWS = [
    [17, 300, 4095, 9, 9, 9, 1234, EOS, 55, 56, 57, 3000, 12, EOS, EOS, 7, 8, 4000, 1, 0, 5, 6],
    [5, EOS, 6, 7, 8, 900, 901, 902, 17, 300, 4095, 9, 2048, 2049, EOS, 1, 2, 3, 4, 5, 6, 7],
]
CHUNKS = [1, 4, 7, 3, 1, 1, 1, 1, 1, 1, 1]  # chunked prefill, then decode steps


def spans(chunks):
    s = 0
    for n in chunks:
        yield s, s + n
        s += n


def test_checkpoint_opens(saved):
    d, model = saved
    ck = metrale_ple.Checkpoint.open(d)
    g = ck.geometry
    assert g["hidden_size"] == 64 and g["hc_mult"] == 4 and g["vocab_size"] == 4096
    assert [s.layer for s in ck.sites] == [1, 2]
    for s, (_, ple) in zip(ck.sites, ple_modules(model)):
        emb = ple.ple_embedding
        assert s.multipliers == emb.layer_multipliers.tolist()
        assert s.head_vocab_sizes == emb.ngram_heads_vocab_sizes.tolist()
        assert s.head_offsets == emb.ngram_heads_offsets.tolist()
        assert s.padded_rows == emb.ngram_embedding.weight.shape[0]


def test_multimodal_checkpoint_opens(tmp_path):
    d = build(tmp_path / "mm", torch.float32, multimodal=True)
    ck = metrale_ple.Checkpoint.open(d)
    assert [s.layer for s in ck.sites] == [1, 2]
    assert ck.geometry["hidden_size"] == 64
    model = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(d).eval()
    ple = model.model.language_model.layers[1].ple
    assert ck.sites[0].multipliers == ple.ple_embedding.layer_multipliers.tolist()


def test_ids_against_ngram_embedding(saved):
    """The row ids Qwen4ExpTextNGramEmbedding gathers (its context carried
    by transformers' cache across chunks) against Site.ids with the
    history carried."""
    d, model = saved
    ck = metrale_ple.Checkpoint.open(d)
    ids_t = torch.tensor(ROWS)
    for s, (li, ple) in zip(ck.sites, ple_modules(model)):
        emb = ple.ple_embedding
        seen = []
        hook = emb.ngram_embedding.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
        cache = new_cache(model)
        hist = [None, None]
        try:
            with torch.no_grad():
                for a, b in spans(CHUNKS):
                    emb(ids_t[:, a:b], cache)
                    got = seen.pop()
                    for r in range(2):
                        mine = s.ids(ROWS[r][a:b], history=hist[r])
                        hist[r] = mine.history
                        np.testing.assert_array_equal(mine.ids, got[r].numpy(), err_msg=f"site {s.index} row {r} [{a}:{b}]")
        finally:
            hook.remove()


@pytest.mark.parametrize("table", ["resident", "cached", "mapped"])
def test_layer_against_ple_layer(saved, table):
    """Qwen4ExpTextPLELayer through transformers' cache (chunked prefill,
    then decode steps; EOS inside, a new sequence after it; a snapshot
    taken and restored in the middle) against Layer over the saved
    table."""
    d, model = saved
    ck = metrale_ple.Checkpoint.open(d)
    C = 4 * 64
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, len(ROWS[0]), C, generator=gen)
    ids_t = torch.tensor(ROWS)
    for s, (li, ple) in zip(ck.sites, ple_modules(model)):
        layer = ck.layer(s.index, table=table, max_tokens=8, slots=256)
        cache = new_cache(model)
        carries = [layer.new_carry(), layer.new_carry()]
        snap = None
        for k, (a, b) in enumerate(spans(CHUNKS)):
            with torch.no_grad():
                want = hidden[:, a:b] + ple(hidden[:, a:b], ids_t[:, a:b], cache)
            got = hidden[:, a:b].clone().contiguous()
            if b - a == 1:
                layer.decode(carries, [r[a] for r in ROWS], got.view(2, C))
            else:
                for r in range(2):
                    layer.prefill(carries[r], ROWS[r][a:b], got[r])
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"site {s.index} chunk {k}")
            if k == 5:
                snap = (copy.deepcopy(cache), [c.snapshot() for c in carries], k, b)
        # Restore the middle snapshot and replay the rest on both sides.
        cache, blobs, k0, start = snap
        for c, blob in zip(carries, blobs):
            c.restore(blob)
        for a, b in list(spans(CHUNKS))[k0 + 1:]:
            with torch.no_grad():
                want = hidden[:, a:b] + ple(hidden[:, a:b], ids_t[:, a:b], cache)
            got = hidden[:, a:b].clone().contiguous()
            layer.decode(carries, [r[a] for r in ROWS], got.view(2, C))
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        for c in carries:
            c.release()


def test_patched_site_against_ple_layer(saved):
    """PatchedPle as the decoder layer calls it (hidden, ids, cache):
    chunked prefill and decode steps through one DynamicCache, then a fresh
    cache starts the rows over."""
    d, model = saved
    ck = metrale_ple.Checkpoint.open(d)
    C = 4 * 64
    hidden = torch.randn(2, len(ROWS[0]), C, generator=torch.Generator().manual_seed(8))
    ids_t = torch.tensor(ROWS)
    for s, (li, ple) in zip(ck.sites, ple_modules(model)):
        site = mtf.PatchedPle(ck.layer(s.index, table="resident"), li, s.index, 2, EOS)
        for _ in range(2):  # the second pass: a fresh cache resets the carries
            c_tf, c_me = new_cache(model), new_cache(model)
            for a, b in spans(CHUNKS):
                x = hidden[:, a:b]
                with torch.no_grad():
                    want = ple(x, ids_t[:, a:b], c_tf)
                    got = site(x, ids_t[:, a:b], c_me)
                torch.testing.assert_close(x + got, x + want, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(c_me.get_conv_state(li, 2), c_tf.get_conv_state(li, 2))


@pytest.fixture(scope="module")
def causal_f32(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gen"), torch.float32, seed=3)


def _generate(model, ids, **kw):
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
            output_logits=True, **kw,
        )


@pytest.mark.parametrize("table", ["cached", "resident", "mapped", "shared"])
def test_patched_generate(causal_f32, table):
    ref = transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval()
    pat = mtf.patch(
        transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval(), causal_f32, table=table
    )
    assert sum(isinstance(l.ple, mtf.PatchedPle) for l in pat.model.layers) == 2
    prompts = [
        torch.tensor([[11, 12, 13, EOS, 14, 15, 16, 17, 18]]),
        torch.tensor([[400, 401, 402, 403], [7, EOS, 9, 10]]),  # a batch; the carries restart
    ]
    for ids in prompts:
        a, b = _generate(ref, ids), _generate(pat, ids)
        assert torch.equal(a.sequences, b.sequences)
        for la, lb in zip(a.logits, b.logits):
            torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)


def test_patched_generate_left_padding_and_continuation(causal_f32):
    ref = transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval()
    pat = mtf.patch(transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval(), causal_f32)
    ids = torch.tensor([[0, 0, 300, 301, 302], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    a = _generate(ref, ids, attention_mask=mask)
    b = _generate(pat, ids, attention_mask=mask)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    # A second generate call that continues the first's cache: the carries
    # continue too.
    one = torch.tensor([[31, 32, 33, 34]])
    ca = _generate(ref, one)
    cb = _generate(pat, one)
    more = torch.cat([ca.sequences, torch.tensor([[EOS, 40, 41]])], dim=1)
    a2 = _generate(ref, more, cache=ca.past_key_values)
    b2 = _generate(pat, more, cache=cb.past_key_values)
    assert torch.equal(a2.sequences, b2.sequences)
    for la, lb in zip(a2.logits, b2.logits):
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)


def test_patched_refuses_beam_search_and_reordered_caches(causal_f32):
    pat = mtf.patch(transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval(), causal_f32)
    ids = torch.tensor([[11, 12, 13]])
    with pytest.raises(ValueError, match="beam search"):
        pat.generate(ids, max_new_tokens=3, num_beams=2)
    # A cache reordered behind the site's back is caught.
    ids2 = torch.tensor([[11, 12, 13], [21, 22, 23]])
    with torch.no_grad():
        out = pat(ids2, use_cache=True)
        cache = out.past_key_values
        cache.reorder_cache(torch.tensor([1, 0]))
        with pytest.raises(RuntimeError, match="reordered or cropped"):
            pat(torch.tensor([[14], [24]]), cache=cache, use_cache=True)
        # Padding other than on the left of a first forward.
        with pytest.raises(ValueError, match="left padding only"):
            pat(torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.tensor([[1, 0, 1, 1]]), use_cache=True)


def test_from_pretrained_without_tables(causal_f32):
    ref = transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval()
    pat = mtf.from_pretrained(causal_f32, table="cached", slots=512).eval()
    assert isinstance(pat.model.layers[1].ple, mtf.PatchedPle)
    assert not any(".ple." in n for n, _ in pat.named_parameters())
    ids = torch.tensor([[11, 12, 13, EOS, 14, 15]])
    a, b = _generate(ref, ids), _generate(pat, ids)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)


def test_patched_multimodal(tmp_path):
    d = build(tmp_path / "mm", torch.float32, multimodal=True, seed=4)
    ref = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(d).eval()
    pat = mtf.from_pretrained(d, table="resident").eval()
    assert isinstance(pat.model.language_model.layers[2].ple, mtf.PatchedPle)
    ids = torch.tensor([[11, 12, 13, 14]])
    a, b = _generate(ref, ids), _generate(pat, ids)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)


def test_patch_refuses_a_foreign_checkpoint(causal_f32, tmp_path):
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(causal_f32).eval()
    other = metrale_ple.init_checkpoint(tmp_path / "tiny", preset="tiny")
    with pytest.raises(ValueError):
        mtf.patch(model, other)
    with pytest.raises(ValueError, match="table must be"):
        mtf.patch(model, causal_f32, table="nowhere")
