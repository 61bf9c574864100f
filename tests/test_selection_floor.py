"""The gather floor of the query-outer selected-attention forward (nsa/backends/triton/selection_floor.py): the
kernel that issues that forward's key/value loads alone must load exactly the selected blocks (its column sums
against torch's over the same tokens), and count the bytes those loads move. Under the interpreter."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa.backends.triton import selection_floor as floor  # noqa: E402
from nsa.backends.triton import triton_unsupported, tuning  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel in the interpreter"),
    pytest.mark.skipif(triton_unsupported() is not None, reason=triton_unsupported() or ""),
]


def _indices(B, T, H, n, nb, seed):
    """Distinct random blocks per row, ascending, the last entries of some rows -1 (as the top-n pads)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(nb, generator=g)[:n].sort().values for _ in range(B * T * H)])
    idx = idx.view(B, T, H, n).to(torch.int32)
    idx[:, :3, :, -1] = -1
    return idx


@pytest.mark.parametrize("B,T,H,D,Dv,l_sel,n,block_s", [(1, 40, 2, 16, 16, 16, 2, 64), (2, 100, 1, 32, 16, 32, 3, 16),
                                                         (2, 48, 2, 16, 32, 16, 3, 64)])
def test_floor_loads_exactly_the_selected_blocks(B, T, H, D, Dv, l_sel, n, block_s):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    nb = -(-T // l_sel)
    idx = _indices(B, T, H, n, nb, 2)
    with tuning.overrides({"selection": {"block_s": block_s}}):
        assert floor.unavailable(k, v, l_sel) is None
        sk, sv = floor.gather_sums(k, v, idx, l_sel)
    rk, rv = floor.gather_sums_reference(k, v, idx, l_sel)
    assert sk.shape == (B, T, H, D) and sv.shape == (B, T, H, Dv)
    torch.testing.assert_close(sk.double(), rk, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sv.double(), rv, rtol=1e-5, atol=1e-4)
    # the comparison can fail: against the sums without one block a row picked, the kernel's sums differ
    bad = idx.clone()
    assert bad[0, 5, 0, 0] >= 0
    bad[0, 5, 0, 0] = -1
    assert not torch.allclose(sk.double(), floor.gather_sums_reference(k, v, bad, l_sel)[0], rtol=1e-5, atol=1e-4)


def test_floor_reference_of_one_row_by_hand():
    k = torch.arange(32 * 16, dtype=torch.float32).view(1, 32, 1, 16)  # token u, column c holds 16u + c
    v = -k
    idx = torch.tensor([1, -1], dtype=torch.int32).expand(1, 32, 1, 2)  # every row: block 1 (tokens 16..31)
    want = [16 * sum(range(16, 32)) + 16 * c for c in range(16)]
    rk, rv = floor.gather_sums_reference(k, v, idx, 16)
    assert rk[0, 0, 0].tolist() == want and torch.equal(rv, -rk)
    sk, sv = floor.gather_sums(k, v, idx, 16)
    assert sk[0, 7, 0].tolist() == want and sv[0, 7, 0].tolist() == [-w for w in want]


def test_floor_refuses_keys_without_descriptors():
    k = torch.randn(1, 32, 1, 2)  # rows of 4 bytes: no TMA descriptor
    assert "no floor" in floor.unavailable(k, k, 16)
    with pytest.raises(ValueError, match="no TMA descriptors"):
        floor.gather_sums(k, k, torch.zeros(1, 32, 1, 1, dtype=torch.int32), 16)


def test_floor_bytes_count_whole_valid_blocks():
    idx = torch.tensor([[[[0, 3, -1]], [[1, -1, -1]]]], dtype=torch.int32)  # [1, 2, 1, 3]: 3 valid
    assert floor.floor_bytes(idx, 64, 128, 128, 2) == 3 * 64 * 256 * 2
