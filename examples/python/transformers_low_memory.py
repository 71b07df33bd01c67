"""Load a Qwen4-Exp model with transformers without its PLE tables in memory.

``metrale_ple.transformers.from_pretrained(dir, table="cached")`` builds the
model with transformers, its PLE modules left out (neither the tables nor
the sites' weights are read), and puts this runtime's PLE sites in their
place: each site reads its table rows from the checkpoint's shard files on
demand through a row cache (``slots`` rows), so the table stays on disk.

This example writes a random Qwen4-Exp (H = 256, hc = 4, PLE at layers 2
and 3, 16 n-gram heads of 16, ~16.8M table rows per site: 1 GiB of bf16
table in all) with transformers, then loads it twice, each in a fresh
process: as transformers loads it, and through
``metrale_ple.transformers.from_pretrained``. Each process reports its
resident set size (RSS) after the load and after a greedy ``generate``,
and its peak RSS; the generated tokens are compared.

Needs torch and transformers 5.25 (Qwen4-Exp) besides metrale_ple.

Usage: python examples/python/transformers_low_memory.py [--model DIR]
       [--dtype bfloat16] [--slots 65536] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = dict(
    vocab_size=32000, hidden_size=256, hc_count=4, ngram_size=3, heads_per_ngram=8,
    ple_layer_ids=[2, 3], split_ngram_parts=4, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_num_key_heads=4, linear_num_value_heads=4, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, hc_lowrank=32,
    ngram_vocab_size_base=1048576, eos_token_id=2, seed=2024, indexer_n_heads=2,
    indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=32, indexer_compress_ratio=4,
)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    # VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across execve,
    # so a child would report its parent's peak.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(d: Path) -> None:
    import torch
    import transformers

    from metrale_ple.transformers import round_ple_to_bf16

    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**TEXT))
    round_ple_to_bf16(model, seed=1)  # random norms/conv, bf16-exact weights
    model.to(torch.bfloat16).save_pretrained(d)


def child(mode: str, d: str, dtype: str, slots: int, new_tokens: int) -> None:
    import torch
    import transformers

    from metrale_ple import transformers as mtf

    base = rss_mib()
    t = time.perf_counter()
    dt = getattr(torch, dtype)
    if mode == "transformers":
        model = transformers.Qwen4ExpForCausalLM.from_pretrained(d, dtype=dt).eval()
    else:
        model = mtf.from_pretrained(d, table="cached", slots=slots, dtype=dt).eval()
    load_s = time.perf_counter() - t
    loaded = rss_mib()
    prompt = torch.arange(100, 164).unsqueeze(0)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        gen_s = time.perf_counter() - t
    print(json.dumps({
        "mode": mode, "import_rss": base, "rss_loaded": loaded, "rss_after_generate": rss_mib(),
        "peak_rss": peak_mib(), "load_s": load_s, "tokens_per_s": new_tokens / gen_s,
        "tokens": out[0, prompt.shape[1]:].tolist(),
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a saved Qwen4-Exp (default: build one)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--slots", type=int, default=65536)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, str(a.model), a.dtype, a.slots, a.new_tokens)
        return
    tmp = tempfile.TemporaryDirectory(prefix="q4e-lowmem-")
    d = a.model or Path(tmp.name) / "model"
    if not (d / "config.json").exists():
        t = time.perf_counter()
        build(d)
        print(f"wrote a random Qwen4-Exp to {d} in {time.perf_counter() - t:.1f} s")
    table = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    print(f"checkpoint: {table / 2**20:.0f} MiB of safetensors (PLE tables included)")
    res = {}
    for mode in ("transformers", "patched"):
        cmd = [sys.executable, __file__, "--child", mode, "--model", str(d), "--dtype", a.dtype,
               "--slots", str(a.slots), "--new-tokens", str(a.new_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[mode] = json.loads(out.strip().splitlines()[-1])
    tf, me = res["transformers"], res["patched"]
    print(f"\n{'MiB':<26}{'transformers':>14}{'patched (cached)':>18}{'saved':>10}")
    for k, label in (("import_rss", "RSS after imports"), ("rss_loaded", "RSS after load"), ("rss_after_generate", "RSS after generate"),
                     ("peak_rss", "peak RSS")):
        print(f"{label:<26}{tf[k]:>14.0f}{me[k]:>18.0f}{tf[k] - me[k]:>10.0f}")
    print(f"{'load (s)':<26}{tf['load_s']:>14.2f}{me['load_s']:>18.2f}")
    print(f"{'generate (tokens/s)':<26}{tf['tokens_per_s']:>14.2f}{me['tokens_per_s']:>18.2f}")
    same = tf["tokens"] == me["tokens"]
    print(f"\nsame {a.new_tokens} greedy tokens: {same}"
          + ("" if same or a.dtype == "float32" else
             " (in bfloat16 transformers computes the PLE in bf16, the runtime in float32)"))


if __name__ == "__main__":
    main()
