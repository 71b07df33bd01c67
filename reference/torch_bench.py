"""PLE forward throughput in PyTorch on the CPU, at the flagship geometry.

The same math as the Rust layer, docs/SPEC.md §5 (Layer math): row gather
from a resident BF16 table, BF16 projections (key and value), then FP32 grouped
RMS norms, gate, dilated causal conv with a carried state, and the highway
add. Prints tokens/s for one 512-token prefill chunk and for decode steps of
batch 1, 16, 32 and 64 (with the projection's GFLOP/s), for side-by-side
comparison with
`cargo bench -p metrale-bench --bench ple_forward`.

Not part of CI: it needs `pip install torch`. Usage:
    python3 reference/torch_bench.py [--rows 3000000] [--reps 5] [--threads N] [--fp32-weights]
"""

import argparse
import math
import os
import tempfile
import time

import torch

H, HC, HEADS, HEAD_DIM, KSIZE, DIL = 2560, 4, 16, 160, 4, 3
C, E = HC * H, HEADS * HEAD_DIM
S = (KSIZE - 1) * DIL
EPS = 1e-6


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w)


class Model:
    def __init__(self, rows, gen, fp32_weights):
        self.table = (torch.rand(rows, HEAD_DIM, generator=gen) * 2 - 1).to(torch.bfloat16)
        self.w = ((torch.rand(C + H, E, generator=gen) * 2 - 1) * 0.02).to(torch.bfloat16)
        self.norm_q = ((torch.rand(HC, H, generator=gen) * 2 - 1) * 0.1)
        self.norm_k = ((torch.rand(HC, H, generator=gen) * 2 - 1) * 0.1)
        self.norm_conv = ((torch.rand(HC, H, generator=gen) * 2 - 1) * 0.1)
        self.conv_w = ((torch.rand(C, KSIZE, generator=gen) * 2 - 1) * 0.5)
        self.rows = rows
        # Optionally hold the (BF16-valued) weights and rows in f32, so the
        # projection runs as an f32 GEMM: the fastest PyTorch path on CPUs
        # without native BF16 dot products.
        self.proj_dtype = torch.float32 if fp32_weights else torch.bfloat16
        if fp32_weights:
            self.w = self.w.float()

    def front(self, ids, highway, t, times):
        """Gather, projection and gate for t rows; returns gated, xn [t, C]."""
        t0 = time.perf_counter()
        emb = self.table.index_select(0, ids).view(t, E).to(self.proj_dtype)
        t1 = time.perf_counter()
        kv = torch.nn.functional.linear(emb, self.w).float()
        t2 = time.perf_counter()
        k = kv[:, :C].view(t, HC, H)
        v = kv[:, C:]
        q = highway.view(t, HC, H)
        g = (rms(q, self.norm_q) * rms(k, self.norm_k)).sum(-1) / math.sqrt(H)
        sigma = torch.sigmoid(torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6)))
        gated = sigma.unsqueeze(-1) * v.unsqueeze(1)
        xn = rms(gated, self.norm_conv).view(t, C)
        t3 = time.perf_counter()
        times[0] += t1 - t0
        times[1] += t2 - t1
        times[2] += t3 - t2
        return gated.view(t, C), xn

    def prefill(self, ids, highway, state, times):
        t = highway.shape[0]
        gated, xn = self.front(ids, highway, t, times)
        t0 = time.perf_counter()
        x = torch.cat([state, xn], 0)
        y = torch.zeros(t, C)
        for j in range(KSIZE):
            y += self.conv_w[:, j] * x[j * DIL: j * DIL + t]
        highway += gated + torch.nn.functional.silu(y)
        state.copy_(x[-S:])
        times[3] += time.perf_counter() - t0

    def decode(self, ids, highway, states, times):
        b = highway.shape[0]
        gated, xn = self.front(ids, highway, b, times)
        t0 = time.perf_counter()
        x = torch.cat([states, xn.unsqueeze(1)], 1)
        y = torch.zeros(b, C)
        for j in range(KSIZE):
            y += self.conv_w[:, j] * x[:, j * DIL]
        highway += gated + torch.nn.functional.silu(y)
        states.copy_(x[:, 1:])
        times[3] += time.perf_counter() - t0


def onednn_report(dtype):
    """What oneDNN ran for one projection-shaped linear in `dtype`: the
    primitive and implementation names from its verbose log (read from the
    process's stdout, where oneDNN writes it), or that it ran none."""
    if not torch.backends.mkldnn.is_available():
        return "oneDNN not built in"
    x = torch.rand(32, E).to(dtype)
    w = torch.rand(C + H, E).to(dtype)
    torch.nn.functional.linear(x, w)
    with tempfile.TemporaryFile(mode="w+b") as f:
        import sys
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.nn.functional.linear(x, w)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        log = f.read().decode(errors="replace")
    used = set()
    for line in log.splitlines():
        parts = line.split(",")
        if parts[0].startswith("onednn_verbose") and "exec" in parts:
            i = parts.index("exec")
            # exec, engine, primitive kind, implementation
            if i + 3 < len(parts):
                used.add(f"{parts[i + 2]} {parts[i + 3]}")
    isa = next((l.split("isa:", 1)[1].strip() for l in log.splitlines() if ",info,cpu,isa:" in l), None)
    if used:
        return "oneDNN ran " + "; ".join(sorted(used)) + (f" (oneDNN ISA: {isa})" if isa else "")
    return "oneDNN ran no primitive for the linear (ATen's own kernel)"


def summary(steps):
    s = sorted(steps)
    return s[len(s) // 2], s[0]


def proj_gflops(times, tokens):
    """The projection's GFLOP/s over `tokens` rows (two FLOPs a weight)."""
    return 2.0 * E * (C + H) * tokens / times[1] / 1e9


def shares(times):
    tot = sum(times)
    names = ["gather", "project", "gate", "conv"]
    return "  ".join(f"{n} {100 * v / tot:.1f}%" for n, v in zip(names, times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--fp32-weights", action="store_true",
                    help="run the projection as an f32 GEMM over BF16-valued weights")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"table {a.rows} rows BF16, projection in {'f32' if a.fp32_weights else 'BF16'}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{onednn_report(torch.float32 if a.fp32_weights else torch.bfloat16)}")
    gen = torch.Generator().manual_seed(1234)
    t0 = time.perf_counter()
    m = Model(a.rows, gen, a.fp32_weights)
    print(f"setup {time.perf_counter() - t0:.1f} s")
    with torch.inference_mode():
        t = 512
        highway = torch.rand(t, C, generator=gen) * 2 - 1
        state = torch.zeros(S, C)
        ids = lambda n: torch.randint(0, m.rows, (n * HEADS,), generator=gen)
        m.prefill(ids(t), highway, state, [0.0] * 4)
        times = [0.0] * 4
        steps = []
        cpu0 = time.process_time()
        for _ in range(a.reps):
            before = sum(times)
            m.prefill(ids(t), highway, state, times)
            steps.append(sum(times) - before)
        cpu = time.process_time() - cpu0
        med, best = summary(steps)
        print(f"prefill chunk {t}: median {t / med:8.1f} tokens/s, best {t / best:8.1f} tokens/s, "
              f"{t * a.reps / cpu:.1f} tokens/CPU-s  "
              f"({med * 1e3:.1f} ms/chunk median; {shares(times)}; "
              f"projection {proj_gflops(times, t * a.reps):.1f} GFLOP/s)")
        for b in (1, 16, 32, 64):
            highway = torch.rand(b, C, generator=gen) * 2 - 1
            states = torch.rand(b, S, C, generator=gen) * 2 - 1
            steps = min(max(a.reps * 64 // b, a.reps), 200)
            m.decode(ids(b), highway, states, [0.0] * 4)
            times = [0.0] * 4
            per_step = []
            cpu0 = time.process_time()
            for _ in range(steps):
                before = sum(times)
                m.decode(ids(b), highway, states, times)
                per_step.append(sum(times) - before)
            cpu = time.process_time() - cpu0
            med, best = summary(per_step)
            print(f"decode batch {b:3d}: median {b / med:8.1f} tokens/s, best {b / best:8.1f} tokens/s, "
                  f"{b * steps / cpu:.1f} tokens/CPU-s  "
                  f"({med * 1e3:.2f} ms/step median; {shares(times)}; "
                  f"projection {proj_gflops(times, b * steps):.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
