"""transformers' own PLE against the patched model, side by side, in one run.

Builds a mid-size random Qwen4-Exp with transformers (written once under
--dir; PLE weights and table rounded to bf16 values, saved in bfloat16) and
times, on the CPU:

1. the PLE layers alone: every site's ``Qwen4ExpTextPLELayer`` against the
   ``PatchedPle`` that ``metrale_ple.transformers.patch`` puts in its place
   (table resident), each through its own ``DynamicCache``: a prefill chunk
   of --chunk tokens (batch 1) and a decode step at batch 1 and --batch
   (median over --reps calls, alternating between the two so that load from
   elsewhere hits both alike);
2. end-to-end greedy ``generate`` tokens/s (median of --runs runs, the
   two models alternating): the table in memory
   (transformers as loaded against patched with ``table="resident"``), and
   the table on disk (transformers with its disk offload, if it loads and
   runs, against ``metrale_ple.transformers.from_pretrained`` with
   ``table="cached"``: the table never read into memory, rows behind the
   row cache).

Prints every figure and each ratio (transformers / patched: above 1 means
the patched model is faster).

Usage: python crates/python/bench/transformers_side_by_side.py [--dir DIR]
       [--dtype float32] [--chunk 128] [--batch 8] [--reps 20]
       [--new-tokens 32] [--runs 3] [--threads N]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers

from metrale_ple import transformers as mtf

# The mid-size model: H = 512, hc = 4 (C = 2048), PLE at layers 2 and 4 of
# 4, 16 n-gram heads of 32 per site, ~4.2M table rows per site (256 MiB of
# bf16 per site).
TEXT = dict(
    vocab_size=32000, hidden_size=512, hc_count=4, ngram_size=3, heads_per_ngram=8,
    ple_layer_ids=[2, 3], split_ngram_parts=4, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2, hc_lowrank=64,
    ngram_vocab_size_base=262144, eos_token_id=2, seed=4321, indexer_n_heads=2,
    indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=64, indexer_compress_ratio=4,
)


def build(d: Path) -> Path:
    if (d / "config.json").exists():
        return d
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**TEXT))
    mtf.round_ple_to_bf16(model, seed=1)
    model.to(torch.bfloat16).save_pretrained(d)
    del model
    gc.collect()
    return d


def med_ms(xs) -> float:
    return statistics.median(xs) * 1e3


def ple_layers(d: Path, dtype, chunk: int, batch: int, reps: int) -> None:
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(d, dtype=dtype).eval()
    ck = mtf.Checkpoint.open(d)
    sites = [(i, l.ple) for i, l in enumerate(model.model.layers) if l.ple is not None]
    by_layer = {s.layer: s.index for s in ck.sites}
    ours = [
        mtf.PatchedPle(ck.layer(by_layer[i], table="resident"), i, by_layer[i], TEXT["ngram_size"] - 1, 2)
        for i, _ in sites
    ]
    C = TEXT["hidden_size"] * TEXT["hc_count"]
    g = torch.Generator().manual_seed(0)

    def run(mods, cache, ids, h):
        for (i, _), m in zip(sites, mods):
            m(h, ids, cache)

    theirs = [m for _, m in sites]
    print(f"\n1. PLE layers ({len(sites)} sites, C = {C}, dtype {str(dtype).replace('torch.', '')}): "
          "median ms per call, all sites")
    print(f"{'call':<28}{'transformers':>14}{'patched':>12}{'ratio':>9}")
    with torch.no_grad():
        # Prefill chunks of one sequence, each continuing the same cache.
        ct, co = transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)
        tt, to = [], []
        for r in range(reps + 2):
            ids = torch.randint(3, TEXT["vocab_size"], (1, chunk), generator=g)
            h = torch.randn(1, chunk, C, generator=g).to(dtype)
            t = time.perf_counter(); run(theirs, ct, ids, h); a = time.perf_counter() - t
            t = time.perf_counter(); run(ours, co, ids, h); b = time.perf_counter() - t
            if r >= 2:
                tt.append(a); to.append(b)
        print(f"{f'prefill chunk of {chunk}':<28}{med_ms(tt):>14.3f}{med_ms(to):>12.3f}{med_ms(tt) / med_ms(to):>9.2f}")
        for B in sorted({1, batch}):
            ct, co = transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)
            ids = torch.randint(3, TEXT["vocab_size"], (B, 16), generator=g)
            h = torch.randn(B, 16, C, generator=g).to(dtype)
            run(theirs, ct, ids, h); run(ours, co, ids, h)
            tt, to = [], []
            for r in range(reps + 2):
                ids = torch.randint(3, TEXT["vocab_size"], (B, 1), generator=g)
                h = torch.randn(B, 1, C, generator=g).to(dtype)
                t = time.perf_counter(); run(theirs, ct, ids, h); a = time.perf_counter() - t
                t = time.perf_counter(); run(ours, co, ids, h); b = time.perf_counter() - t
                if r >= 2:
                    tt.append(a); to.append(b)
            print(f"{f'decode step, batch {B}':<28}{med_ms(tt):>14.3f}{med_ms(to):>12.3f}{med_ms(tt) / med_ms(to):>9.2f}")
    for m in ours:
        m.reset()
    del model, ours, sites, theirs
    gc.collect()


def tokens_per_s(pair, prompt, new_tokens: int, runs: int):
    """Median tokens/s of greedy generate for each of the two models of
    ``pair``, the runs alternating between them; and each one's tokens."""
    times = [[], []]
    seqs = [None, None]
    with torch.no_grad():
        for m in pair:
            if m is not None:
                m.generate(prompt, max_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(runs):
            for k, m in enumerate(pair):
                if m is None:
                    continue
                t = time.perf_counter()
                out = m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                times[k].append(time.perf_counter() - t)
                seqs[k] = out[0].tolist()
    rates = [new_tokens / statistics.median(ts) if ts else None for ts in times]
    return rates, seqs


def end_to_end(d: Path, dtype, new_tokens: int, runs: int, work: Path) -> None:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, TEXT["vocab_size"], (1, 64), generator=g)
    print(f"\n2. generate: prompt 64 tokens, {new_tokens} new tokens, batch 1, greedy; "
          f"median tokens/s of {runs} runs, alternating")
    rows = []

    ref = transformers.Qwen4ExpForCausalLM.from_pretrained(d, dtype=dtype).eval()
    pat = mtf.patch(transformers.Qwen4ExpForCausalLM.from_pretrained(d, dtype=dtype).eval(), d, table="resident")
    (tf_mem, me_mem), (seq_ref, seq_mem) = tokens_per_s((ref, pat), prompt, new_tokens, runs)
    del ref, pat
    gc.collect()
    rows.append(("table in memory", tf_mem, me_mem, seq_ref == seq_mem))

    # The table on disk: transformers' disk offload of every site's table,
    # and failing that, device_map="auto" under a CPU memory limit below
    # the model's size; against the row cache.
    off = work / "offload"
    tf_model, how = None, None
    attempts = [
        ("device_map: each site's ngram_embedding on 'disk'", dict(
            device_map={"": "cpu", **{
                f"model.layers.{i - 1}.ple.ple_embedding.ngram_embedding": "disk" for i in TEXT["ple_layer_ids"]
            }})),
        ("device_map='auto', max_memory cpu 512MiB", dict(device_map="auto", max_memory={"cpu": 512 << 20})),
        ("device_map='auto', max_memory cpu 64MiB", dict(device_map="auto", max_memory={"cpu": 64 << 20})),
    ]
    for label, kw in attempts:
        shutil.rmtree(off, ignore_errors=True)
        try:
            m = transformers.Qwen4ExpForCausalLM.from_pretrained(d, dtype=dtype, offload_folder=str(off), **kw).eval()
            with torch.no_grad():
                m.generate(prompt, max_new_tokens=2, do_sample=False)  # it runs
            on_disk = sorted(k for k, v in (getattr(m, "hf_device_map", None) or {}).items() if v == "disk")
            how = f"{label}; on disk: {', '.join(on_disk) or 'nothing'}"
            tf_model = m
            break
        except Exception as e:  # report it and try the next placement
            print(f"   transformers disk offload with {label}: failed: {type(e).__name__}: {str(e)[:200]}")
    pat = mtf.from_pretrained(d, table="cached", dtype=dtype).eval()
    (tf_disk, me_disk), (seq_disk, seq_cached) = tokens_per_s((tf_model, pat), prompt, new_tokens, runs)
    del pat, tf_model
    gc.collect()
    shutil.rmtree(off, ignore_errors=True)
    rows.append(("table on disk", tf_disk, me_disk, seq_ref == seq_cached))

    print(f"{'':<20}{'transformers':>14}{'patched':>12}{'ratio':>9}   patched tokens = transformers' (in memory)")
    for name, a, b, same in rows:
        if a is None:
            print(f"{name:<20}{'n/a':>14}{b:>12.2f}{'n/a':>9}   {same}")
        else:
            print(f"{name:<20}{a:>14.2f}{b:>12.2f}{b / a:>9.2f}   {same}")
    if how:
        print(f"   transformers on disk: {how}")
    else:
        print("   transformers on disk: no disk offload placement loaded and ran (errors above)")
    print("   ratio: patched tokens/s over transformers' tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="generate runs per model")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's threads and the runtime's (RAYON_NUM_THREADS), alike")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
        # The runtime's thread pool starts on first use and reads this.
        os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    work = Path(tempfile.mkdtemp(prefix="q4e-bench-"))
    d = a.dir or work / "model"
    dtype = getattr(torch, a.dtype)
    t = time.perf_counter()
    build(d)
    print(f"model: {d} (built or reused in {time.perf_counter() - t:.1f} s); torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {torch.get_num_threads()} torch threads, "
          f"{os.environ.get('RAYON_NUM_THREADS') or os.cpu_count()} runtime threads, {os.cpu_count()} CPUs")
    try:
        ple_layers(d, dtype, a.chunk, a.batch, a.reps)
        end_to_end(d, dtype, a.new_tokens, a.runs, work)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
