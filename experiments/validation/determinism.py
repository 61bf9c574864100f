"""Check ``determinism``: each path run twice on the same inputs, compared bit for bit (``torch.equal``).

Required (the check fails where two runs differ): every forward (the compressed branch with its top-n,
the selected branch, the window, the whole layer with and without a gradient) and the decode step (a
captured GraphDecoder step replayed twice on a GPU; the module's cached step elsewhere). Measured and
stated, not required: the backward of each branch and of the layer. The selection backward adds dK/dV
with float32 atomics (nsa/backends/triton/selection.py): the order of the adds, so the last bits, may
change from run to run; the compressed and window backwards sum their split partials in a fixed order.
"""
from __future__ import annotations

import torch

from nsa import NSAAttention, dispatch
from nsa import functional as fn
from nsa.decode import GraphDecoder

from ..measure.inputs import fill_cache
from .core import Check, Context
from .decode_breakdown import uses_decoder
from .report import Table, Text

NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


def _inputs(c, B, T, device, dtype, seed=0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    H, HQ, Tc = c.n_kv_heads, c.n_heads, c.n_cmp(T)
    shapes = {"q": (B, T, HQ, c.d_k), "k_cmp": (B, Tc, H, c.d_k), "v_cmp": (B, Tc, H, c.d_v), "k_sel": (B, T, H, c.d_k),
              "v_sel": (B, T, H, c.d_v), "k_win": (B, T, H, c.d_k), "v_win": (B, T, H, c.d_v)}
    x = {n: (torch.randn(*s, generator=g, device=device) * (2.0 if n[0] in "qk" else 1.0)).to(dtype) for n, s in shapes.items()}
    x["gates"] = torch.rand(B, T, HQ, 3, generator=g, device=device).to(dtype)
    return x


def _grads(f, leaves: list[torch.Tensor], dout_seed: int = 7) -> tuple:
    xs = [t.detach().requires_grad_() for t in leaves]
    o = f(*xs)
    o = o[0] if isinstance(o, tuple) else o
    g = torch.Generator(device=o.device).manual_seed(dout_seed)
    dout = torch.randn(o.shape, generator=g, device=o.device).to(o.dtype)
    return torch.autograd.grad(o, xs, dout)


def paths(ctx: Context) -> list[tuple[str, bool, object]]:
    """(name, required, a callable returning tensors) of every path compared."""
    job, d = ctx.job, ctx.size.determinism
    c, dev, dt, plan = job.nsa, job.device, job.dtype, job.plan
    x = _inputs(c, int(d.batch), int(d.seq), dev, dt)
    S, sc = int(d.seq), c.d_k ** -0.5
    be = {b: dispatch.choose(b, plan[b], dev, dt, job.fallback) for b in dispatch.BRANCHES}
    with torch.no_grad():
        _, idx = be["cmp"].compressed(x["q"], x["k_cmp"], x["v_cmp"], c, scale=sc, q_start=0, n_keys=S)

    def cmp(q, k, v):
        return be["cmp"].compressed(q, k, v, c, scale=sc, q_start=0, n_keys=S)

    def sel(q, k, v):
        return be["sel"].selected(q, k, v, idx, c, scale=sc, q_start=0)

    def win(q, k, v):
        return be["win"].window(q, k, v, c, scale=sc, q_start=0)

    def layer(*a):
        return fn.nsa_attention(*a, c, backend=plan, fallback=job.fallback, streams=bool(job.cfg.streams))

    ins = {"cmp": ["q", "k_cmp", "v_cmp"], "sel": ["q", "k_sel", "v_sel"], "win": ["q", "k_win", "v_win"], "layer": list(NAMES)}
    fns = {"cmp": cmp, "sel": sel, "win": win, "layer": layer}
    out = []
    for name in ("cmp", "sel", "win"):
        label = f"{name} ({plan[name]})"
        out.append((f"forward {label}", True, lambda f=fns[name], n=ins[name]: _no_grad(f, [x[k] for k in n])))
    out.append(("forward layer, no gradient (fused gate)", True, lambda: _no_grad(layer, [x[k] for k in NAMES])))
    out.append(("forward layer, with gradient", True,
                lambda: (layer(*(x[k].detach().requires_grad_() for k in NAMES)).detach(),)))
    out.append(("decode step", True, decode_step(ctx)))
    for name in ("cmp", "sel", "win", "layer"):
        label = f"{name} ({plan[name]})" if name != "layer" else "layer"
        out.append((f"backward {label}: every input's gradient", False,
                    lambda f=fns[name], n=ins[name]: _grads(f, [x[k] for k in n])))
    return out


def _no_grad(f, args) -> tuple:
    with torch.no_grad():
        o = f(*args)
    return o if isinstance(o, tuple) else (o,)


def decode_step(ctx: Context):
    """A callable running one decode step at a fixed position: a captured GraphDecoder step on CUDA with
    triton, the module's cached forward elsewhere."""
    job, d = ctx.job, ctx.size.determinism
    c, dev, dt, B, S = job.nsa, job.device, job.dtype, int(d.batch), int(d.seq)
    torch.manual_seed(int(job.cfg.seed))
    layer = NSAAttention(c, backend=job.plan, fallback=job.fallback).to(dev, dt).eval()
    cache = layer.new_cache(B, S, dev, dt)
    with torch.no_grad():
        fill_cache(layer, cache, S - 1, int(job.cfg.decode.fill_tokens))
        xs = torch.randn(B, 1, c.dim, device=dev, dtype=dt)
    if uses_decoder(job):
        dec = GraphDecoder(layer, cache)
        dec.capture(advance=False)  # one captured step at position S-1
        return lambda: (dec.replay(xs).clone(),)

    def step():
        cache.length = S - 1
        with torch.no_grad():
            return (layer(xs, cache),)
    return step


def run(ctx: Context) -> Check:
    c, d = Check("determinism"), ctx.size.determinism
    rows = []
    for name, required, f in paths(ctx):
        a, b = f(), f()
        same = all(torch.equal(u, w) for u, w in zip(a, b))
        diff = max((float((u.double() - w.double()).abs().max()) for u, w in zip(a, b) if u.numel()), default=0.0)
        rows.append({"path": name, "required": required, "bit_identical": same, "max_abs_diff": diff})
        if required:
            c.require(same, f"{name}: two runs differ (max abs difference {diff:.3g})")
    c.rows = rows
    c.metrics = {"paths_identical": float(sum(r["bit_identical"] for r in rows)), "paths": float(len(rows))}
    req = [r for r in rows if r["required"]]
    rep = [r for r in rows if not r["required"]]
    c.figures = (f"{sum(r['bit_identical'] for r in req)} of {len(req)} required paths bit-identical; backward "
                 f"(stated, not required): " + ", ".join(f"{r['path'].split(':')[0].removeprefix('backward ')} "
                                                         f"{'identical' if r['bit_identical'] else 'differs'}" for r in rep))
    dt = str(ctx.job.dtype).replace("torch.", "")
    c.blocks.append(Text(f"Each path twice on the same inputs (B={d.batch}, T={d.seq}, {dt}, "
                         "backends " + ", ".join(f"{b}={n}" for b, n in ctx.job.plan.items()) + "), compared with "
                         "torch.equal. Required: every forward and the decode step. Stated: the backwards (the selection "
                         "backward adds dK/dV with float32 atomics, whose order may change between runs)."))
    c.blocks.append(Table(["path", "required", "bit-identical", "max abs difference"],
                          [[r["path"], "yes" if r["required"] else "no (stated)", "yes" if r["bit_identical"] else "NO",
                            f"{r['max_abs_diff']:.3g}"] for r in rows]))
    return c
