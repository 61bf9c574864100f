"""Parity: each configured backend against the reference, output and every input gradient.

    python -m experiments.parity -m seq=64,128                 # CPU: float32 under test, float64 reference
    python -m experiments.parity backend=triton seq=8192       # GPU: bf16 under test, fp32-upcast reference

Random inputs in the tested dtype; the reference sees the same values upcast (float64 on CPU,
float32 on GPU; parity.ref_dtype overrides). The selected branch of both sides uses the
reference's block indices, so a top-n tie flipped by rounding shows up once, as
``index_mismatch_frac``, instead of as a large output error. With all branches, the forward is also
run without gradients (``out_no_grad``: the prefill/inference path, where a backend may fuse the
gated sum into its selected branch). A tensor over its tolerance
(parity.tol.<dtype>: rel_l2, and max_abs times max(1, max |reference|)) fails the run after
everything is logged.
With ``parallel.cp=N`` under ``torchrun --nproc_per_node N`` (docs/cluster.md), the run compares
context-parallel NSA with the same backends on one device instead (:func:`cp_work`: ``cp_max_rel_err``).
"""
from __future__ import annotations

import contextlib

import logging

import hydra
import torch
from omegaconf import DictConfig

from nsa import context_parallel as cp
from nsa import dispatch, functional, reference
from nsa.backends.triton import poisoned_outputs
from nsa.numerics import rel_l2

from .framework import Charts, Job, Result, check_memory, launch, run_job
from .framework.config import DTYPES

TENSORS = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
log = logging.getLogger("experiments.parity")


def estimate_bytes(job: Job) -> float:
    c, B, S = job.nsa, job.cfg.parity.batch, job.seq
    # Inputs, outputs and gradients in the reference dtype (at most fp64) and the dtype under test; the
    # reference's gathers and scores live one query chunk at a time (nsa.reference.CHUNK_BYTES, a few
    # of them alive at once in backward), so they add a constant, not a term in S.
    per_token = c.n_heads * (c.d_k + c.d_v) * 6 + c.n_kv_heads * (c.d_k + c.d_v) * 12
    idx = 2 * B * S * c.n_kv_heads * c.bounded(S).n_sel * 8  # the reference's and the tested top-n (int64)
    return float(B * S * per_token * 8 + 8 * reference.CHUNK_BYTES + idx)


def cp_estimate_bytes(job: Job) -> float:
    """Rank 0's device tensors under parallel.cp (the float64 draws stay on the host): its part with
    gradients, the gathered output and gradients, and the one-device run's inputs, gradients and output,
    all in the dtype under test (about 7 tensors of q's size and 24 of one key/value branch's), plus the
    comparison's float64 copies of the largest pair and their difference (nsa.numerics.rel_l2)."""
    c, B, S = job.nsa, job.cfg.parity.batch, job.seq
    q_size, kv_size = c.n_heads * (c.d_k + c.d_v) / 2, c.n_kv_heads * (c.d_k + c.d_v) / 2
    per_token = (7 * q_size + 24 * kv_size) * job.dtype.itemsize + 3 * c.n_heads * c.d_k * 8
    return float(B * S * per_token)


def check_fits(job: Job) -> None:
    """ResourceLimit where the job's estimate (rank 0's under parallel.cp) exceeds the limit (``run_job``
    calls this before the run is created)."""
    check_memory(job, cp_estimate_bytes(job) if int(job.cfg.parallel.cp) > 1 else estimate_bytes(job))


def _forward(be, x, c, branch, idx_ref, scale, record, streams=False):
    """Output of the gated branches (or the forced one) with the given backends; idx: ref's. All
    branches: ``nsa.functional.gated_branches``, the path ``nsa_attention`` takes (its gated sum, and
    on CUDA with ``streams`` the window on a second stream), with the reference's indices."""
    pick = (lambda b: dispatch.choose(b, be[b], x["q"].device, x["q"].dtype, None)) if record else \
        (lambda b: dispatch.get("reference"))
    if branch == "none":
        return functional.gated_branches(*(x[n] for n in TENSORS), c, {b: pick(b) for b in ("cmp", "sel", "win")},
                                         scale=scale, streams=streams, indices=idx_ref)
    S = x["k_sel"].shape[1]
    c = c.bounded(S)  # n_sel beyond the blocks of S keys selects them all (as nsa.functional bounds it)
    outs, idx = {}, None
    if branch in ("cmp", "sel"):
        outs["cmp"], idx = pick("cmp").compressed(x["q"], x["k_cmp"], x["v_cmp"], c, scale=scale, q_start=0, n_keys=S)
    if branch == "sel":
        outs["sel"] = pick("sel").selected(x["q"], x["k_sel"], x["v_sel"], idx_ref if idx_ref is not None else idx,
                                           c, scale=scale, q_start=0)
    if branch == "win":
        outs["win"] = pick("win").window(x["q"], x["k_win"], x["v_win"], c, scale=scale, q_start=0)
    return outs[branch], idx


def near_ties(ref, idx_ref, idx_test, c, scale, rel_tol, max_rows):
    """Tell near-ties apart from wrong selections. For each (b, t, group) row whose selected set
    differs from the reference's (up to ``max_rows`` rows), recompute the reference's group scores
    (Eqs. 8-10) for that query and pair the blocks only the test chose with those only the reference
    chose, both sorted by score: the row is a near-tie iff every pair's scores differ by at most
    ``rel_tol`` x the row's largest score (forced blocks have no score and must agree exactly).
    Returns (rows checked, rows that are not near-ties)."""
    diff = (idx_test != idx_ref).any(-1).nonzero().tolist()[:max_rows]
    bad = 0
    for b, t, h in diff:
        sl = slice(b, b + 1)
        with torch.no_grad():
            _, p_cmp = reference.compressed_attention(ref["q"][sl, t:t + 1].detach(), ref["k_cmp"][sl].detach(),
                                                      ref["v_cmp"][sl].detach(), c, scale=scale, q_start=t)
            score = reference.selection_scores(p_cmp, c, c.n_blocks(t + 1))[0, 0, h].double().cpu()
        last = t // c.l_sel
        forced = {j for j in range(last + 1) if j < c.n_init or j > last - c.n_local}
        a = {j for j in idx_ref[b, t, h].tolist() if j >= 0}
        e = {j for j in idx_test[b, t, h].tolist() if j >= 0}
        only_ref, only_test = sorted(a - e), sorted(e - a)
        if len(only_ref) != len(only_test) or (set(only_ref) | set(only_test)) & forced:
            bad += 1
            continue
        eps = rel_tol * float(score.max())
        s_ref = sorted(float(score[j]) for j in only_ref)
        s_test = sorted(float(score[j]) for j in only_test)
        bad += any(abs(x - y) > eps for x, y in zip(s_ref, s_test))
    return len(diff), bad


def _rel_l2(a: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error (``nsa.numerics.rel_l2``), max abs error) of ``a`` against ``r``, in float64."""
    if r.numel() == 0:
        return 0.0, 0.0
    return rel_l2(a, r), float((a.double() - r.double()).abs().max())


def _gather_whole(x: torch.Tensor, cp_group) -> torch.Tensor | None:
    """On rank 0, the whole sequence of ``x`` (every rank's part, nsa.context_parallel's layout); None elsewhere."""
    import torch.distributed as dist

    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(cp_group.world)] if cp_group.rank == 0 else None
    dist.gather(x, parts, dst=0, group=cp_group.group)
    return cp.unshard(parts) if parts is not None else None


def _flat_grad(m: torch.nn.Module) -> torch.Tensor:
    """A module's parameter gradients as one vector. phi's gradient is compared whole, not per parameter:
    the key phi's output bias shifts every compressed key's score of a query by the same q.b, which the
    softmax (and the top-n) cancel, so its gradient is zero up to rounding, and a relative error of that
    rounding against rounding says nothing."""
    return torch.cat([p.grad.detach().reshape(-1) for p in m.parameters()])


def cp_work(job: Job) -> Result:
    """parallel.cp > 1 (under torchrun): context-parallel NSA (``nsa.context_parallel.nsa_attention``) against
    the same backends on one device, on the same inputs. Every rank draws the whole sequence's inputs (the
    compression branch's raw keys/values, before phi) and the output gradient from the seed, and runs its
    part (two mirrored chunks); rank 0 gathers the output and every input gradient, sums phi's parameter
    gradients over the ranks, then runs the whole sequence alone and compares: ``cp_max_rel_err`` is the
    largest relative L2 error over them. Over parity.tol.<dtype>.rel_l2 fails the run."""
    import torch.distributed as dist

    from nsa import NSAAttention

    p, c, S, dev, dt, g = job.cfg.parity, job.nsa, job.seq, job.device, job.dtype, job.cp
    B, H, HQ, Dk, Dv = p.batch, c.n_kv_heads, c.n_heads, c.d_k, c.d_v
    torch.manual_seed(int(job.cfg.seed))
    layer = NSAAttention(c).to(dev, dt)  # phi (the MLP of model.nsa.phi=mlp) from the seed: the same on every rank
    phis = {"phi_k": layer.phi_k, "phi_v": layer.phi_v}
    gen = torch.Generator(device="cpu").manual_seed(int(job.cfg.seed))
    shapes = {"q": (B, S, HQ, Dk), "k_cmp_raw": (B, S, H, Dk), "v_cmp_raw": (B, S, H, Dv), "k_sel": (B, S, H, Dk),
              "v_sel": (B, S, H, Dv), "k_win": (B, S, H, Dk), "v_win": (B, S, H, Dv), "gates": (B, S, HQ, 3)}
    base = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    base["gates"] = torch.sigmoid(base["gates"])
    dout = torch.randn(B, S, HQ, Dv, generator=gen, dtype=torch.float64)
    log.info(f"[parity] seq={S}: context parallel over {g.world} ranks ({g.backend}), backends {job.plan} in {dt}, "
             f"against one device")
    part = {n: cp.shard(t, g.rank, g.world).to(dev, dt).requires_grad_(True) for n, t in base.items()}
    o = cp.nsa_attention(*part.values(), c, phi_k=layer.phi_k, phi_v=layer.phi_v, group=g.group, backend=job.plan,
                         fallback=job.fallback)
    o.backward(cp.shard(dout, g.rank, g.world).to(dev, dt))
    got = {"out": _gather_whole(o, g), **{f"grad_{n}": _gather_whole(t.grad, g) for n, t in part.items()}}
    for k, m in phis.items():  # each rank's phi gradient is that of its queries: summed, the one-device gradient
        if m is not None:
            for prm in m.parameters():
                dist.all_reduce(prm.grad, group=g.group)
            got[f"grad_{k}"] = _flat_grad(m)
            m.zero_grad(set_to_none=True)
    del o, part
    if g.rank != 0:
        return Result([], {})
    whole = {n: t.to(dev, dt).requires_grad_(True) for n, t in base.items()}
    o1 = functional.nsa_attention(whole["q"], functional.compress(whole["k_cmp_raw"], c, layer.phi_k),
                                  functional.compress(whole["v_cmp_raw"], c, layer.phi_v), whole["k_sel"],
                                  whole["v_sel"], whole["k_win"], whole["v_win"], whole["gates"], c, backend=job.plan,
                                  fallback=job.fallback)
    o1.backward(dout.to(dev, dt))
    ref = {"out": o1.detach(), **{f"grad_{n}": t.grad for n, t in whole.items()},
           **{f"grad_{k}": _flat_grad(m) for k, m in phis.items() if m is not None}}
    tol = float(p.tol[job.cfg.dtype].rel_l2)
    rows, metrics = [], {}
    for name, r in ref.items():
        rel, mx = _rel_l2(got[name], r)
        rows.append({"seq_tokens": S, "cp": g.world, "tensor": name, "dtype": str(dt).replace("torch.", ""),
                     "rel_l2_err": rel, "max_abs_err": mx, "rel_l2_tol": tol, "within_tol": rel <= tol})
        metrics[f"cp_{name}_rel_l2_err"] = rel
        log.info(f"[parity] seq={S} cp={g.world} {name:>14}: " + ("ok  " if rel <= tol else "FAIL")
                 + f" rel_l2={rel:.3g} max_abs={mx:.3g}")
    worst = max(rows, key=lambda r: r["rel_l2_err"])
    metrics["cp_max_rel_err"] = worst["rel_l2_err"]
    bad = [r["tensor"] for r in rows if not r["within_tol"]]
    metrics["parity_failures"] = len(bad)
    failure = (f"parity: context parallel over {g.world} ranks differs from one device: cp_max_rel_err "
               f"{worst['rel_l2_err']:.3g} ({worst['tensor']}) over parity.tol.{job.cfg.dtype}.rel_l2={tol:g} in "
               + ", ".join(bad)) if bad else None
    return Result(rows, metrics, headline={"cp_max_rel_err": worst["rel_l2_err"]}, failure=failure)


def work(job: Job) -> Result:
    check_fits(job)
    if job.cp is not None:  # parallel.cp > 1: context parallel against one device
        return cp_work(job)
    p, c, S, dev, dt = job.cfg.parity, job.nsa, job.seq, job.device, job.dtype
    ref_dt = DTYPES[p.ref_dtype] if p.ref_dtype else (torch.float64 if dev.type == "cpu" else torch.float32)
    tol = p.tol[job.cfg.dtype]
    B, H, HQ, Dk, Dv = p.batch, c.n_kv_heads, c.n_heads, c.d_k, c.d_v
    g = torch.Generator(device="cpu").manual_seed(int(job.cfg.seed))
    shapes = {"q": (B, S, HQ, Dk), "k_cmp": (B, c.n_cmp(S), H, Dk), "v_cmp": (B, c.n_cmp(S), H, Dv),
              "k_sel": (B, S, H, Dk), "v_sel": (B, S, H, Dv), "k_win": (B, S, H, Dk), "v_win": (B, S, H, Dv),
              "gates": (B, S, HQ, 3)}
    base = {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    base["gates"] = torch.sigmoid(base["gates"])
    test = {n: t.to(dev, dt).requires_grad_(True) for n, t in base.items()}
    ref = {n: t.detach().to(ref_dt).requires_grad_(True) for n, t in test.items()}  # same values, upcast
    scale = Dk ** -0.5
    log.info(f"[parity] seq={S}: reference in {ref_dt}, backends {job.plan} in {dt}")
    o_ref, idx_ref = _forward(None, ref, c, job.branch, None, scale, record=False)
    dout = torch.randn(o_ref.shape, generator=g, dtype=torch.float64)
    o_ref.backward(dout.to(dev, ref_dt))
    # Triton kernels write into NaN-filled outputs here: an element they skip fails the comparison.
    poison = poisoned_outputs() if "triton" in job.plan.values() else contextlib.nullcontext()
    with poison:
        o_test, idx_test = _forward(job.plan, test, c, job.branch, idx_ref, scale, record=True,
                                    streams=job.cfg.streams)
        o_test.backward(dout.to(dev, dt))
        o_inf = None
        if job.branch == "none":  # the forward without gradient: prefill/inference (gated sum fused)
            with torch.no_grad():
                o_inf, _ = _forward(job.plan, test, c, job.branch, idx_ref, scale, record=True,
                                    streams=job.cfg.streams)
    log.info(f"[parity] seq={S}: forward and backward done, comparing {1 + len(TENSORS)} tensors")

    pairs = [("out", o_test.detach(), o_ref.detach())]
    if o_inf is not None:
        pairs.append(("out_no_grad", o_inf, o_ref.detach()))
    pairs += [(f"grad_{n}", test[n].grad, ref[n].grad) for n in TENSORS if ref[n].grad is not None]
    rows, metrics, bad = [], {}, []
    for name, a, r in pairs:
        if a is None:
            bad.append(f"{name}: the backend produced no gradient")
            continue
        d = a.to(ref_dt) - r
        empty = d.numel() == 0
        ref_max = 0.0 if empty else float(r.abs().max())
        err = {"mean_abs_err": 0.0 if empty else float(d.abs().mean()),
               "max_abs_err": 0.0 if empty else float(d.abs().max()),
               "rel_l2_err": rel_l2(a, r)}
        limit = tol.max_abs * max(1.0, ref_max)  # max_abs tolerances scale with the tensor's magnitude
        ok = err["max_abs_err"] <= limit and err["rel_l2_err"] <= tol.rel_l2
        rows.append({"seq_tokens": S, "tensor": name, "dtype": str(dt).replace("torch.", ""),
                     "ref_dtype": str(ref_dt).replace("torch.", ""), **err, "ref_max_abs": ref_max,
                     "max_abs_limit": limit, "rel_l2_tol": tol.rel_l2, "within_tol": ok})
        metrics.update({f"{name}_{k}": v for k, v in err.items()})
        if not ok:
            bad.append(f"{name} max_abs {err['max_abs_err']:.3g} (limit {limit:.3g}), "
                       f"rel_l2 {err['rel_l2_err']:.3g} (tol {tol.rel_l2:g})")
    if idx_ref is not None:
        frac = float((idx_test != idx_ref).float().mean())
        checked, not_tie = near_ties(ref, idx_ref, idx_test, c, scale, tol.near_tie_rel, p.max_tie_rows)
        ok = frac <= tol.index_mismatch and not_tie == 0
        rows.append({"seq_tokens": S, "tensor": "indices", "dtype": str(dt).replace("torch.", ""),
                     "ref_dtype": str(ref_dt).replace("torch.", ""), "index_mismatch_frac": frac,
                     "index_mismatch_tol": tol.index_mismatch, "mismatched_rows_checked": checked,
                     "mismatched_rows_not_near_tie": not_tie, "near_tie_rel_tol": tol.near_tie_rel,
                     "within_tol": ok})
        metrics["index_mismatch_frac"] = frac
        metrics["index_rows_not_near_tie"] = not_tie
        if frac > tol.index_mismatch:
            bad.append(f"indices differ in {frac:.3%} of slots (tol {tol.index_mismatch:.3%})")
        if not_tie:
            bad.append(f"{not_tie} of {checked} rows with differing indices are not near-ties of the reference scores")
    metrics["parity_failures"] = len(bad)
    for r in rows:
        log.info(f"[parity] seq={S} {r['tensor']:>12}: " + ("ok  " if r["within_tol"] else "FAIL") + " "
                   + ", ".join(f"{k}={r[k]:.3g}" for k in ("max_abs_err", "rel_l2_err", "index_mismatch_frac") if k in r))
    failure = f"parity: {len(bad)} over tolerance: " + "; ".join(bad) if bad else None
    errs = [r for r in rows if "rel_l2_err" in r]
    headline = {"worst_rel_l2_err": max(r["rel_l2_err"] for r in errs), "worst_max_abs_err": max(r["max_abs_err"] for r in errs)}
    return Result(rows, metrics, headline=headline, failure=failure, charts=Charts("seq_tokens", "tensor", ("rel_l2_err",)))


@hydra.main(config_path="../conf", config_name="parity", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "parity", work, fits=check_fits)


if __name__ == "__main__":
    launch(main, "parity")
