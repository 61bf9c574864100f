"""The whole NSA attention forward (triton backend, no gradient) at the benchmark shape: timed A/B
variants, or one call for Nsight Compute.

    python3 scripts/bench_layer_fwd.py --T 65536                 # A/B table (median ms, do_bench)
    ncu --clock-control none --metrics "$(python3 scripts/bench_layer_fwd.py --metrics)" \
        -k regex:'_fwd_q_kernel|_fwd_kernel|_topn_kernel' python3 scripts/bench_layer_fwd.py --once

bf16, B=1, HQ=64, H=4, D=128 (``bench_cmp_win.cfg_for``). Variants: the gated sum (Eq. 5) in the
selection kernel's epilogue (what ``nsa_attention`` runs without a gradient) or as its own kernel
after the selected branch (what it runs with one); the sliding branch on a second stream, started
after the compressed kernel (``on_scored``, the default) or before it, or on the main stream.
Each variant's output is compared with the first's; --tune repeats them under launch overrides.
--metrics: throughputs (percent of peak) and bytes that say what bounds a kernel: L2, DRAM, L1,
tensor pipe, issue, occupancy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_bytes.sum",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_elapsed",
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--once", action="store_true", help="one untimed forward (streams off), for a profiler")
    ap.add_argument("--metrics", action="store_true", help="print the metric list for ncu --metrics and exit")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs"))
    ap.add_argument("--paths", choices=("default", "all"), default="all",
                    help="default: only what nsa_attention runs without a gradient; all: the six variants")
    ap.add_argument("--tune", nargs="*", default=[""],
                    help="_cmp_ops.TUNE['cuda'] overrides, one run of the paths per item: 'win_warps=8,win_maxnreg=128'")
    a = ap.parse_args()
    if a.metrics:
        print(",".join(METRICS))
        return
    import torch
    import triton.testing

    from bench_cmp_win import cfg_for, inputs
    from nsa import dispatch, functional
    from nsa.backends.triton import _cmp_ops

    cfg = cfg_for()
    x = inputs(cfg, 1, a.T, torch.bfloat16, seed=1)
    gates = torch.rand(1, a.T, cfg.n_heads, 3, device="cuda", dtype=torch.bfloat16)
    args = (x["q"], x["kc"], x["vc"], x["kw"], x["vw"], x["kw"], x["vw"], gates, cfg)
    tri = dispatch.get("triton")

    class WindowFirst(type(tri)):  # the side stream's window starts before the compressed kernel
        def compressed(self, *a, on_scored=None, **k):
            if on_scored is not None:
                on_scored()
            return super().compressed(*a, **k)

    be = {"cmp": tri, "sel": tri, "win": tri}

    def run(sep, streams, first=False):
        b = dict(be, cmp=WindowFirst()) if first else be
        return functional.gated_branches(*args, b, scale=cfg.d_k ** -0.5, streams=streams, fuse_gate=not sep)[0]

    with torch.no_grad():
        if a.once:
            o = run(False, False)  # the forward nsa_attention runs without a gradient, streams off
            torch.cuda.synchronize()
            print(f"nsa forward T={a.T}: o {tuple(o.shape)} finite={bool(torch.isfinite(o).all())}")
            return
        rows, first = [], None
        paths = ((False, True, False), (True, True, False), (False, True, True), (True, True, True),
                 (False, False, False), (True, False, False))
        base = dict(_cmp_ops.TUNE["cuda"])
        for item in a.tune:
            over = {k: int(v) for k, v in (kv.split("=") for kv in item.split(",") if kv)}
            _cmp_ops.TUNE["cuda"].clear()  # keys an earlier item added (maxnreg, ...) must not stay
            _cmp_ops.TUNE["cuda"].update(base, **over)
            for sep, streams, wfirst in paths[: 1 if a.paths == "default" else None]:
                o = run(sep, streams, wfirst).float()
                first = o if first is None else first
                rel = ((o - first).norm() / first.norm()).item()
                ms = triton.testing.do_bench(lambda: run(sep, streams, wfirst), warmup=100, rep=500,
                                             return_mode="median")
                rows.append(dict(T=a.T, tune=over, gate="separate kernel" if sep else "selection epilogue",
                                 streams=streams, window=("before" if wfirst else "after") + " the compressed kernel"
                                 if streams else "main stream", fwd_ms=ms, rel_diff_vs_first=rel))
                print(rows[-1], flush=True)
        _cmp_ops.TUNE["cuda"].clear()
        _cmp_ops.TUNE["cuda"].update(base)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "layer_fwd.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
