"""op=decode: the decode step's kernels (``nsa.decode.GraphDecoder``, the triton backend's
``DecodeKernels``) for the query at position seq-1 over a cache of seq tokens, each part alone.

The check (``op.check_steps`` steps after a prefill of ``min(seq, kernels.check_seq)`` tokens): the
decoder's steps (CUDA-graph replays on a GPU, eager steps on a CPU) against the module's own cached
forward on the reference backend (``check_step_rel_l2``), then the attention kernels of the last step
against the reference branches on the same caches, q and gates (``check_attend_rel_l2``; the selected
branch on the kernels' indices) and the kernels' top-n against the reference's
(``check_indices_index_mismatch``).

Timed over a cache filled with standard-normal keys/values (each row captured in a CUDA graph on a
GPU): ``nsa`` (the attention step: compressed pass + top-n, selected + window, combine with gates),
``cmp``, ``cmp_no_topk``, ``sel``, ``win`` (each alone, no combine; sel reads the last top-n's blocks),
``combine`` (the gated combine alone), ``layer`` (the whole layer step: projections, RoPE, cache write,
compression, attention, output projection), ``module_eager`` (the module's own cached forward, one
eager step), ``dense`` (SDPA decode over seq keys, same heads). The kernels count the key/value tokens
they load; a count that differs from the one from the indices (``nsa.decode.tokens_read``) fails the
job. ``fwd_bytes``: the keys/values those tokens hold, against the profile's ``peak_hbm_gbps``
(``hbm_floor_ms``).
"""
from __future__ import annotations

import torch

from nsa import NSAAttention, dispatch, reference
from nsa.decode import BRANCHES, GraphDecoder, tokens_read

from ..measure.dense import dense_attention
from ..measure.timing import decode_launch_tags, graph_step
from .bench import Bench

CACHES = ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")


def check(b: Bench) -> None:
    c, B, P, steps = b.c, b.B, b.check_seq, int(b.op.check_steps)
    m = NSAAttention(c).to(b.dev, b.dt).eval()  # backend "reference": the module's cached forward is the reference
    x = b.randn(B, P + steps, c.dim)
    cache, ref_cache = m.new_cache(B, P + steps, b.dev, b.dt), m.new_cache(B, P + steps, b.dev, b.dt)
    dec = GraphDecoder(m, cache, backend="triton")  # the kernels under test, beside the reference layer
    ys, refs = [], []
    with torch.no_grad():
        dec.prefill(x[:, :P])
        m(x[:, :P], ref_cache)
        if b.dev.type == "cuda":
            dec.capture()
        for t in range(P, P + steps):
            xt = x[:, t:t + 1]
            ys.append((dec.replay(xt) if b.dev.type == "cuda" else dec.step(xt)).clone())
            refs.append(m(xt, ref_cache))
        b.compare("step", torch.cat(ys, 1), torch.cat(refs, 1))
        t, S = P + steps - 1, P + steps
        q, g = dec.last["q"], dec.last["gates"]
        o = dec.attend(q, g, position=t).clone()
        idx = dec.indices()
        f = lambda z: z.to(b.ref_dtype)
        qr, nc = f(q)[:, None], c.n_cmp(S)
        o_c, idx_r = reference.compressed_branch(qr, f(cache.k_cmp[:, :nc]), f(cache.v_cmp[:, :nc]), c, q_start=t,
                                                 n_keys=S)
        o_s = reference.selected_attention(qr, f(cache.k_sel[:, :S]), f(cache.v_sel[:, :S]), idx, c, q_start=t)
        o_w = reference.sliding_window_attention(qr, f(cache.k_win[:, :S]), f(cache.v_win[:, :S]), c, q_start=t)
        o_ref = dispatch.get("reference").combine(o_c, o_s, o_w, f(g)[:, None])[:, 0]
    b.compare("attend", o, o_ref)
    b.compare_indices("indices", idx, idx_r)


def decoder(b: Bench):
    """A layer on the triton backend, a cache of seq tokens (normal keys/values), its decoder at seq-1."""
    c, S = b.c, b.T
    m = NSAAttention(c, backend="triton").to(b.dev, b.dt).eval()
    cache = m.new_cache(b.B, S, b.dev, b.dt)
    for name in CACHES:
        getattr(cache, name).normal_(generator=b.gen)
    cache.length = S - 1
    q, g = b.randn(b.B, c.n_heads, c.d_k), b.rand(b.B, c.n_heads, 3)
    return m, cache, GraphDecoder(m, cache), q, g


def timed(b: Bench) -> None:
    c, B, S = b.c, b.B, b.T
    m, cache, dec, q, g = decoder(b)
    b.tags.update(decode_launch_tags(dec))
    xs = b.randn(B, 1, c.dim)
    with torch.no_grad():
        dec.attend(q, g, position=S - 1, count=True)  # the top-n the sel row reads; the kernels' counts
        counted = dec.token_counts().cpu()
        from_idx = tokens_read(c, S, dec.indices())
        for i, br in enumerate(BRANCHES):
            if not torch.equal(counted[..., i], from_idx[br]):
                b.failures.append(f"decode kernels counted {counted[..., i].double().mean():.1f} {br} tokens per "
                                  f"group, the indices give {from_idx[br].double().mean():.1f}")
        parts = {
            "nsa": lambda: dec.attend(q, g),
            "cmp": lambda: dec.attend(q, g, branches=("cmp",), combine=False),
            "cmp_no_topk": lambda: dec.attend(q, g, branches=("cmp",), combine=False, topk=False),
            "sel": lambda: dec.attend(q, g, branches=("sel",), combine=False),
            "win": lambda: dec.attend(q, g, branches=("win",), combine=False),
            "combine": lambda: dec.attend(q, g, branches=(), combine_branches=BRANCHES),
            "layer": dec.step_fn(xs, advance=False),
        }
        kd, vd = (b.randn(B, S, c.n_kv_heads, d) for d in (c.d_k, c.d_v))
        qd = q[:, None]
        dense = lambda: dense_attention(qd, kd, vd, causal=False)
        cuda = b.dev.type == "cuda"
        fns = {k: dec.graph(fn).replay if cuda else fn for k, fn in parts.items()}
        fns["dense"] = graph_step(dense, b.dev) if cuda else dense

        def module_step():
            cache.length = S - 1
            m(xs, cache)

        fns["module_eager"] = module_step
        elem = q.element_size()
        per_tok = (c.d_k + c.d_v) * elem
        toks = {"nsa": counted.sum(-1), **{br: counted[..., i] for i, br in enumerate(BRANCHES)}}
        toks["cmp_no_topk"] = toks["cmp"]
        for name, fn in fns.items():
            extra = {}
            if name in toks:
                extra = {"kv_tokens_read_per_step_per_group": float(toks[name].double().mean()),
                         "nbytes": float(toks[name].sum()) * per_tok}
            elif name == "dense":
                extra = {"kv_tokens_read_per_step_per_group": float(S), "nbytes": float(B * c.n_kv_heads * S * per_tok)}
            if name == "nsa":
                extra.update(kv_tokens_distinct_per_step_per_group=float(from_idx["distinct"].double().mean()),
                             kv_tokens_formula_per_step_per_group=from_idx["formula"])
            nbytes = extra.pop("nbytes", None)
            row = b.row(name, fn, nbytes=nbytes, **extra)
            if nbytes is not None:
                row["hbm_floor_ms"] = nbytes / (float(b.job.profile.peak_hbm_gbps) * 1e9) * 1e3
    by = {r["variant"]: r for r in b.rows}
    b.metrics["nsa_speedup_vs_dense_x"] = by["dense"]["fwd_p50_ms"] / by["nsa"]["fwd_p50_ms"]


def once(b: Bench) -> None:
    _, _, dec, q, g = decoder(b)
    with torch.no_grad():
        dec.attend(q, g, position=b.T - 1)
