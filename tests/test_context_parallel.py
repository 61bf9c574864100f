"""Context-parallel NSA (nsa/context_parallel.py) against the single-device computation: real
``torch.distributed`` process groups (gloo, one process per rank, spawned), float64 on the reference
backend, and float32 on the triton backend (its kernels under the interpreter).

Every rank feeds its part of one sequence (two mirrored chunks) and gets its part of the output; the parts
put together equal ``nsa.functional.nsa_attention`` over the whole sequence, and so do the gradients of q,
the gates and every branch's raw keys and values (reduce-scattered by the all-gather's backward); phi's
parameter gradients summed over the ranks equal the single-device ones. 2 and 3 ranks, chunks that cut
compression blocks, selection blocks and the window; phi = MLP and mean. And the layer with ``cp_group``
against the layer on one device (outputs, input and parameter gradients). Packed documents (``cu_seqlens``):
the same against the single-device packed call and the layer on the whole packed sequence, with documents
that span chunks and ranks, empty and one-token documents and ones shorter than l and l_sel.
"""
from __future__ import annotations

import gc
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # the triton backend's case: its kernels on CPU tensors, here and in the ranks

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nsa import NSAAttention, NSAConfig, functional
from nsa import context_parallel as cp
from nsa.module import PhiMLP
from nsa.varlen import Varlen

NAMES = ("q", "k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win", "gates")
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _problem(T: int, phi: str):
    """The whole sequence's inputs, phi and the loss weights, the same in every process (seeded)."""
    torch.manual_seed(0)
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_k=8, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=12, n_init=1,
                    n_local=1, phi=phi)
    B, HQ, H = 2, cfg.n_heads, cfg.n_kv_heads
    r = lambda *s: torch.randn(*s, dtype=torch.float64)  # noqa: E731
    x = {"q": r(B, T, HQ, cfg.d_k), "k_cmp_raw": r(B, T, H, cfg.d_k), "v_cmp_raw": r(B, T, H, cfg.d_v),
         "k_sel": r(B, T, H, cfg.d_k), "v_sel": r(B, T, H, cfg.d_v), "k_win": r(B, T, H, cfg.d_k),
         "v_win": r(B, T, H, cfg.d_v), "gates": torch.rand(B, T, HQ, 3, dtype=torch.float64)}
    phis = (PhiMLP(cfg.l, cfg.d_k, 10).double(), PhiMLP(cfg.l, cfg.d_v, 10).double()) if phi == "mlp" else (None, None)
    weight = r(B, T, HQ, cfg.d_v)
    return cfg, x, phis, weight


def _rank(rank: int, body, world: int, init: str, *args) -> None:
    """One rank: ``body(rank, world, *args)`` (which saves this rank's results) inside a gloo group.

    A clean exit, not a C++ teardown left to chance: the ranks meet at a barrier (none closes its sockets
    while another still exchanges with it), every tensor and autograd node of the body is gone before the
    group is destroyed (an autograd node of ``all_gather`` keeps the group alive otherwise, and a gloo group
    destroyed during interpreter finalization can abort the process: SIGABRT, seen in CI), and the process
    then leaves without finalization. A failing body raises as usual (its traceback reaches mp.spawn)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    body(rank, world, *args)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _attention_body(rank: int, world: int, T: int, phi: str, out: str) -> None:
    cfg, x, (pk, pv), weight = _problem(T, phi)
    part = {n: cp.shard(v, rank, world).requires_grad_() for n, v in x.items()}
    o = cp.nsa_attention(*(part[n] for n in NAMES), cfg, phi_k=pk, phi_v=pv)
    (o * cp.shard(weight, rank, world)).sum().backward()
    phi_grads = {f"{k}.{n}": p.grad for k, m in (("k", pk), ("v", pv)) if m is not None
                 for n, p in m.named_parameters()}
    torch.save({"o": o.detach(), "grads": {n: part[n].grad for n in NAMES}, "phi": phi_grads}, f"{out}/{rank}.pt")


@pytest.mark.parametrize("world,T,phi", [(2, 40, "mlp"), (3, 36, "avg")], ids=["2ranks-T40-mlp", "3ranks-T36-mean"])
def test_context_parallel_equals_one_device(tmp_path, world, T, phi):
    mp.spawn(_rank, args=(_attention_body, world, str(tmp_path / "init"), T, phi, str(tmp_path)), nprocs=world,
             join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    cfg, x, (pk, pv), weight = _problem(T, phi)
    full = {n: v.clone().requires_grad_() for n, v in x.items()}
    o = functional.nsa_attention(full["q"], functional.compress(full["k_cmp_raw"], cfg, pk),
                                 functional.compress(full["v_cmp_raw"], cfg, pv), full["k_sel"], full["v_sel"],
                                 full["k_win"], full["v_win"], full["gates"], cfg)
    (o * weight).sum().backward()
    torch.testing.assert_close(cp.unshard([p["o"] for p in parts]), o.detach(), **TOL)
    for n in NAMES:
        torch.testing.assert_close(cp.unshard([p["grads"][n] for p in parts]), full[n].grad, **TOL, msg=n)
    phi_ref = {f"{k}.{n}": p.grad for k, m in (("k", pk), ("v", pv)) if m is not None for n, p in m.named_parameters()}
    assert set(phi_ref) == set(parts[0]["phi"]) and (phi != "mlp" or phi_ref)
    for n, g in phi_ref.items():
        torch.testing.assert_close(sum(p["phi"][n] for p in parts), g, **TOL, msg=n)


def _triton_body(rank: int, world: int, T: int, out: str) -> None:
    cfg, x, _, weight = _problem(T, "avg")
    part = {n: cp.shard(v.float(), rank, world).requires_grad_() for n, v in x.items()}
    o = cp.nsa_attention(*(part[n] for n in NAMES), cfg, backend="triton")
    (o * cp.shard(weight.float(), rank, world)).sum().backward()
    torch.save({"o": o.detach(), "grads": {n: part[n].grad for n in NAMES}}, f"{out}/{rank}.pt")


@pytest.mark.usefixtures("fast_interpreter")
def test_context_parallel_on_the_triton_backend(tmp_path):
    """Each rank's branches on the triton kernels (the interpreter, float32) at its q_start: the output and the
    gradients equal the kernels' on the whole sequence to float32 rounding (the all-gather's backward
    sums the ranks' parts in another order)."""
    pytest.importorskip("triton")
    world, T = 2, 40
    mp.spawn(_rank, args=(_triton_body, world, str(tmp_path / "init"), T, str(tmp_path)), nprocs=world, join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    cfg, x, _, weight = _problem(T, "avg")
    full = {n: v.float().clone().requires_grad_() for n, v in x.items()}
    o = functional.nsa_attention(full["q"], functional.compress(full["k_cmp_raw"], cfg),
                                 functional.compress(full["v_cmp_raw"], cfg), full["k_sel"], full["v_sel"],
                                 full["k_win"], full["v_win"], full["gates"], cfg, backend="triton")
    (o * weight.float()).sum().backward()
    # float32 rounding: the interpreter's dots (numpy) sum a rank's 10-row tiles and the whole sequence's in
    # orders that differ on some CPUs (2.4e-7 at most, seen on a 2-core machine); a wrong row or block is O(1)
    torch.testing.assert_close(cp.unshard([p["o"] for p in parts]), o.detach(), rtol=1e-5, atol=1e-6)
    for n in NAMES:
        torch.testing.assert_close(cp.unshard([p["grads"][n] for p in parts]), full[n].grad, rtol=1e-5, atol=1e-5,
                                   msg=n)


def _layer(T: int):
    torch.manual_seed(1)
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_k=8, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=12, n_init=1,
                    n_local=1, gate_hidden=8, phi_hidden=10)
    layer = NSAAttention(cfg).double()
    x = torch.randn(2, T, cfg.dim, dtype=torch.float64)
    weight = torch.randn(2, T, cfg.dim, dtype=torch.float64)
    return layer, x, weight


def _layer_body(rank: int, world: int, T: int, out: str) -> None:
    layer, x, weight = _layer(T)
    xr = cp.shard(x, rank, world).requires_grad_()
    y = layer(xr, cp_group=dist.group.WORLD)
    (y * cp.shard(weight, rank, world)).sum().backward()
    torch.save({"y": y.detach(), "x": xr.grad, "params": {n: p.grad for n, p in layer.named_parameters()}},
               f"{out}/{rank}.pt")


def test_layer_with_a_cp_group_equals_the_layer_on_one_device(tmp_path):
    """The module: RoPE at each rank's own positions, phi and the gate MLP, o_proj; input and parameter
    gradients (the latter summed over the ranks)."""
    world, T = 2, 32
    mp.spawn(_rank, args=(_layer_body, world, str(tmp_path / "init"), T, str(tmp_path)), nprocs=world, join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    layer, x, weight = _layer(T)
    x.requires_grad_()
    y = layer(x)
    (y * weight).sum().backward()
    torch.testing.assert_close(cp.unshard([p["y"] for p in parts]), y.detach(), **TOL)
    torch.testing.assert_close(cp.unshard([p["x"] for p in parts]), x.grad, **TOL)
    for n, prm in layer.named_parameters():
        torch.testing.assert_close(sum(p["params"][n] for p in parts), prm.grad, **TOL, msg=n)
    with pytest.raises(ValueError, match="cp_group: context parallelism runs a whole sequence"):
        layer(x, layer.new_cache(2, T), cp_group=object())


def test_shard_and_unshard():
    x = torch.arange(12)[None, :]
    assert cp.shard(x, 0, 3).tolist() == [[0, 1, 10, 11]] and cp.shard(x, 2, 3).tolist() == [[4, 5, 6, 7]]
    assert torch.equal(cp.unshard([cp.shard(x, r, 3) for r in range(3)]), x)
    with pytest.raises(ValueError, match="must split into 2 x 4 ranks = 8 equal chunks"):
        cp.shard(x, 0, 4)


# --- packed documents (cu_seqlens) -------------------------------------------------------------------------
# T=48 over 2 ranks: chunks of 12, rank 0 holds packed rows [0,12) and [36,48), rank 1 [12,36). T=36 over 3
# ranks: chunks of 6, rank 0 [0,6) [30,36), rank 1 [6,12) [24,30), rank 2 [12,24). With l=8, l_sel=8, w=12.
LAYOUTS = {
    2: {
        # shorter than l (3), empty, one token, a document over chunks 0-2 (ranks 0 and 1, 4 selection
        # blocks: a real top-n), one over the chunk 2/3 boundary (ranks 1 -> 0), one token, 7 tokens
        "short-empty-one-spanning": [0, 3, 3, 4, 34, 40, 41, 48],
        "one-document": [0, 48],
        # boundaries on chunk boundaries, empty documents there and at the end, a document over chunks 0-2
        "at-chunk-boundaries": [0, 5, 12, 12, 30, 36, 48, 48],
    },
    # a document over chunks 0-2 (ranks 0, 1, 2), empty, one token, one over chunks 3-4 (ranks 2 -> 1)
    3: {"three-ranks": [0, 2, 17, 17, 18, 30, 36]},
}
REL = 1e-10


def _packed_problem(T: int, phi: str, dtype=torch.float64):
    """As _problem, packed: batch 1."""
    cfg, x, phis, weight = _problem(T, phi)
    return cfg, {n: v[:1].to(dtype) for n, v in x.items()}, phis, weight[:1].to(dtype)


def _cu(cu) -> torch.Tensor:
    return torch.tensor(cu, dtype=torch.int32)


def _varlen_body(rank: int, world: int, T: int, phi: str, out: str) -> None:
    cfg, x, (pk, pv), weight = _packed_problem(T, phi)
    res = {}
    for name, cu in LAYOUTS[world].items():
        for m in (pk, pv):
            if m is not None:
                m.zero_grad(set_to_none=True)
        part = {n: cp.shard(v, rank, world).requires_grad_() for n, v in x.items()}
        o = cp.nsa_attention(*(part[n] for n in NAMES), cfg, phi_k=pk, phi_v=pv, cu_seqlens=_cu(cu))
        (o * cp.shard(weight, rank, world)).sum().backward()
        res[name] = {"o": o.detach(), "grads": {n: part[n].grad for n in NAMES},
                     "phi": {f"{k}.{n}": p.grad for k, m in (("k", pk), ("v", pv)) if m is not None
                             for n, p in m.named_parameters()}}
    part = [cp.shard(x[n], rank, world) for n in NAMES]
    errors = []
    for bad in ([0, 4, T - 8], [0, T + 2]):  # the gathered sequence has T tokens
        try:
            cp.nsa_attention(*part, cfg, cu_seqlens=_cu(bad))
        except ValueError as e:
            errors.append(str(e))
    res["errors"] = errors
    torch.save(res, f"{out}/{rank}.pt")


def _one_device(cfg, x, phis, weight, cu, backend="reference"):
    """functional.nsa_attention on the whole packed sequence: output, input gradients, phi's gradients."""
    pk, pv = phis
    for m in phis:
        if m is not None:
            m.zero_grad(set_to_none=True)
    full = {n: v.clone().requires_grad_() for n, v in x.items()}
    o = functional.nsa_attention(full["q"], functional.compress(full["k_cmp_raw"], cfg, pk, cu_seqlens=cu),
                                 functional.compress(full["v_cmp_raw"], cfg, pv, cu_seqlens=cu), full["k_sel"],
                                 full["v_sel"], full["k_win"], full["v_win"], full["gates"], cfg, backend=backend,
                                 cu_seqlens=cu)
    (o * weight).sum().backward()
    phi = {f"{k}.{n}": p.grad for k, m in (("k", pk), ("v", pv)) if m is not None for n, p in m.named_parameters()}
    return o.detach(), {n: full[n].grad for n in NAMES}, phi


@pytest.mark.parametrize("world,T,phi", [(2, 48, "mlp"), (3, 36, "avg")], ids=["2ranks-T48-mlp", "3ranks-T36-mean"])
def test_packed_documents_equal_one_device(tmp_path, world, T, phi):
    """Documents that span chunk boundaries and ranks, empty ones, one-token ones, ones shorter than l and
    l_sel: each rank's output and every input gradient equal the single-device packed call's, phi's
    parameter gradients summed over the ranks too (float64, relative L2 1e-10)."""
    from nsa.numerics import rel_l2

    mp.spawn(_rank, args=(_varlen_body, world, str(tmp_path / "init"), T, phi, str(tmp_path)), nprocs=world,
             join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    cfg, x, phis, weight = _packed_problem(T, phi)
    for name, cu in LAYOUTS[world].items():
        o, grads, phi_ref = _one_device(cfg, x, phis, weight, _cu(cu))
        got = [p[name] for p in parts]
        assert rel_l2(cp.unshard([g["o"] for g in got]), o) <= REL, name
        for n in NAMES:
            assert rel_l2(cp.unshard([g["grads"][n] for g in got]), grads[n]) <= REL, (name, n)
        assert set(phi_ref) == set(got[0]["phi"]) and (phi != "mlp" or phi_ref)
        if phi_ref:  # as one vector: the key phi's output bias has a zero gradient up to rounding (the softmax
            # cancels it), so its own relative error would measure rounding only
            summed = torch.cat([sum(p["phi"][n] for p in got).flatten() for n in phi_ref])
            assert rel_l2(summed, torch.cat([g.flatten() for g in phi_ref.values()])) <= REL, name
    if world == 2:  # the bad inputs: a cu_seqlens whose total is not the gathered token count
        for p in parts:
            assert len(p["errors"]) == 2, p["errors"]
            for e, n in zip(p["errors"], (T - 8, T + 2)):
                assert e.startswith(f"cu_seqlens: its last offset N={n} must be the token count of the whole "
                                    f"sequence (this rank's 2C={T // world} tokens x {world} ranks), which has {T}"), e


def _triton_varlen_body(rank: int, world: int, T: int, cu: list, out: str) -> None:
    cfg, x, _, weight = _packed_problem(T, "avg", torch.float32)
    part = {n: cp.shard(v, rank, world).requires_grad_() for n, v in x.items()}
    o = cp.nsa_attention(*(part[n] for n in NAMES), cfg, backend="triton", cu_seqlens=_cu(cu))
    (o * cp.shard(weight, rank, world)).sum().backward()
    torch.save({"o": o.detach(), "grads": {n: part[n].grad for n in NAMES}}, f"{out}/{rank}.pt")


@pytest.mark.usefixtures("fast_interpreter")
def test_packed_documents_on_the_triton_backend(tmp_path):
    """The head pieces (one document at a q_start) and the packed bodies on the triton kernels (the
    interpreter, float32): output and gradients equal the kernels' packed call on the whole sequence to
    float32 rounding (relative L2 1e-5)."""
    pytest.importorskip("triton")
    from nsa.numerics import rel_l2

    world, T, cu = 2, 48, LAYOUTS[2]["short-empty-one-spanning"]
    mp.spawn(_rank, args=(_triton_varlen_body, world, str(tmp_path / "init"), T, cu, str(tmp_path)), nprocs=world,
             join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    cfg, x, _, weight = _packed_problem(T, "avg", torch.float32)
    o, grads, _ = _one_device(cfg, x, (None, None), weight, _cu(cu), backend="triton")
    assert rel_l2(cp.unshard([p["o"] for p in parts]), o) <= 1e-5
    for n in NAMES:
        assert rel_l2(cp.unshard([p["grads"][n] for p in parts]), grads[n]) <= 1e-5, n


def _layer_varlen_body(rank: int, world: int, T: int, cu: list, out: str) -> None:
    layer, x, weight = _layer(T)
    docs = Varlen(_cu(cu))
    xr = cp.shard(x[:1], rank, world).requires_grad_()
    y = layer(xr, cu_seqlens=docs, cp_group=dist.group.WORLD)
    (y * cp.shard(weight[:1], rank, world)).sum().backward()
    try:
        layer(xr, cu_seqlens=_cu([0, 5, T - 2]), cp_group=dist.group.WORLD)
        error = None
    except ValueError as e:
        error = str(e)
    torch.save({"y": y.detach(), "x": xr.grad, "params": {n: p.grad for n, p in layer.named_parameters()},
                "error": error}, f"{out}/{rank}.pt")


def test_layer_with_a_cp_group_and_packed_documents(tmp_path):
    """The module on packed documents: RoPE at each token's position in its document on every rank, phi per
    document; output, input and parameter gradients (summed over the ranks) equal the layer on the whole
    packed sequence; a cu_seqlens of the wrong total is refused, naming cu_seqlens."""
    from nsa.numerics import rel_l2

    world, T, cu = 2, 48, LAYOUTS[2]["short-empty-one-spanning"]
    mp.spawn(_rank, args=(_layer_varlen_body, world, str(tmp_path / "init"), T, cu, str(tmp_path)), nprocs=world,
             join=True)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    layer, x, weight = _layer(T)
    x = x[:1].clone().requires_grad_()
    y = layer(x, cu_seqlens=_cu(cu))
    (y * weight[:1]).sum().backward()
    assert rel_l2(cp.unshard([p["y"] for p in parts]), y.detach()) <= REL
    assert rel_l2(cp.unshard([p["x"] for p in parts]), x.grad) <= REL
    for n, prm in layer.named_parameters():
        got = sum(p["params"][n] for p in parts)
        if n == "phi_k.fc2.bias":  # zero up to rounding (the softmax cancels it): on both sides
            assert float(prm.grad.norm()) < 1e-14 and float(got.norm()) < 1e-14
        else:
            assert rel_l2(got, prm.grad) <= REL, n
    for p in parts:
        assert p["error"] == (f"cu_seqlens: its last offset N={T - 2} must be the token count of the whole sequence "
                              f"(x's 2C={T // world} tokens x {world} ranks), which has {T}")


def test_positions_of_packed_documents():
    """Each rank's RoPE positions: counted from each token's document start (documents [0,3), empty, [3,4),
    [4,10), [10,12); 3 ranks of two 2-token chunks)."""
    cu = _cu([0, 3, 3, 4, 10, 12])
    got = [cp.positions(12, r, 3, cu_seqlens=cu).tolist() for r in range(3)]
    assert got == [[0, 1, 0, 1], [2, 0, 4, 5], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="cu_seqlens: its last offset N=12 must be the token count"):
        cp.positions(16, 0, 2, cu_seqlens=cu)
