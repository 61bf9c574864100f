"""NSAConfig: the layer's shape and sparsity, validated at construction.

Names follow the paper (Yuan et al., arXiv 2502.11089) and ``docs/nsa-spec.md``:
l, d (compression block and stride, Eq. 7), l_sel and n_sel (selection, Eqs. 9-12), w (window),
n_init / n_local (forced initial and most recent blocks).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

PHI_CHOICES = ("mlp", "avg")
PHI_INITS = ("random", "mean")
KV_INITS = ("random", "tied")


@dataclass(frozen=True)
class NSAConfig:
    dim: int
    n_heads: int
    n_kv_heads: int
    d_k: int
    d_v: int
    l: int = 32  # noqa: E741  (the paper's name)
    d: int = 16
    l_sel: int = 64
    n_sel: int = 16
    w: int = 512
    n_init: int = 1
    n_local: int = 2
    phi: str = "mlp"
    rope_base: float = 10000.0
    gate_hidden: int = 64
    phi_hidden: int = 0  # 0: 2 * head dim
    # Initialisation and parameterisation choices the paper leaves open (docs/nsa-spec.md "Module level"):
    # gate_bias: the gate MLP's initial output bias per branch (cmp, sel, win), i.e. g = sigmoid(bias) at
    # the start; None keeps the module's default init (zero in experiments.lm's model: every gate 0.5).
    gate_bias: tuple | None = None
    # shared_kv: one key and one value projection read by all three branches (as fla's and lucidrains' NSA
    # do) instead of the paper's independent keys and values per branch (Section 3.3.3).
    shared_kv: bool = False
    # phi_init (phi = mlp): "random" keeps the module's init (in experiments.lm, std 0.02: phi's output starts
    # ~50x smaller than the keys it compresses); "mean" starts the MLP as mean pooling over the block, exactly
    # (GELU(z) - GELU(-z) = z: needs phi_hidden 0 or >= 2 * head dim), and it learns from there.
    phi_init: str = "random"
    # kv_init (shared_kv = false): "random" keeps each branch's key/value projection's own init; "tied" starts the
    # compressed and window branches' projections as copies of the selected branch's (the paper's independent
    # projections, one starting point: compressed scores then rank blocks by the keys the selected branch
    # reads), and each learns on its own from there.
    kv_init: str = "random"
    # Biases of the input projections (q and every branch's k/v) and of the output projection, as a converted
    # model's dense attention has them (Qwen2: q/k/v; Llama with attention_bias: all four; nsa.integrations.hf).
    qkv_bias: bool = False
    o_bias: bool = False

    def __post_init__(self):
        def bad(field, rule):
            raise ValueError(f"NSAConfig.{field}={getattr(self, field)!r}: {rule}")

        for f in ("dim", "n_heads", "n_kv_heads", "d_k", "d_v", "l", "d", "l_sel", "n_sel", "w"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f, "must be an integer")
            if v < 1:
                bad(f, "must be positive (>= 1)")
        for f in ("n_init", "n_local", "gate_hidden", "phi_hidden"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f, "must be an integer")
            if v < 0:
                bad(f, "must be non-negative (>= 0)")
        if self.n_heads % self.n_kv_heads:
            bad("n_heads", f"must be divisible by n_kv_heads={self.n_kv_heads}")
        if self.l % self.d:
            bad("l", f"must be a multiple of the stride d={self.d}")
        if self.l_sel % self.d:
            bad("l_sel", f"must be a multiple of the stride d={self.d}")
        if self.n_sel < self.n_init + self.n_local:
            bad("n_sel", f"must be >= n_init + n_local = {self.n_init + self.n_local}")
        if self.phi not in PHI_CHOICES:
            bad("phi", f"must be one of {PHI_CHOICES}")
        if self.gate_bias is not None:
            gb = self.gate_bias
            if (isinstance(gb, (str, bytes)) or not hasattr(gb, "__len__") or len(gb) != 3
                    or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) < float("inf")
                           for v in gb)):
                bad("gate_bias", "must be null or 3 finite numbers (cmp, sel, win)")
            object.__setattr__(self, "gate_bias", tuple(float(v) for v in gb))  # hashable, whatever the input
        if self.phi_init not in PHI_INITS:
            bad("phi_init", f"must be one of {PHI_INITS}")
        if self.kv_init not in KV_INITS:
            bad("kv_init", f"must be one of {KV_INITS}")
        if self.phi_init == "mean" and self.phi == "mlp" and 0 < self.phi_hidden < 2 * max(self.d_k, self.d_v):
            bad("phi_init", f"'mean' needs phi_hidden >= 2 * max(d_k, d_v) = {2 * max(self.d_k, self.d_v)} (or 0)")
        for f in ("shared_kv", "qkv_bias", "o_bias"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be true or false")
        rb = self.rope_base
        if isinstance(rb, bool) or not isinstance(rb, (int, float)) or not (0 < rb < float("inf")):
            bad("rope_base", "must be positive and finite")

    @property
    def G(self) -> int:
        """Query heads per key/value group."""
        return self.n_heads // self.n_kv_heads

    def n_cmp(self, T: int) -> int:
        """Compressed tokens over T raw tokens: 0 if T < l else (T - l) // d + 1."""
        return 0 if T < self.l else (T - self.l) // self.d + 1

    def n_blocks(self, T: int) -> int:
        """Selection blocks that hold at least one of T raw tokens."""
        return -(-T // self.l_sel)

    def sel_count(self, n_blocks: int) -> int:
        """Blocks the top-n keeps among ``n_blocks`` candidates: n_sel, bounded by the blocks that exist
        (with fewer candidates Eq. 12 takes them all), and never below n_init + n_local (the forced ones)."""
        return min(self.n_sel, max(n_blocks, self.n_init + self.n_local))

    def bounded(self, S: int) -> "NSAConfig":
        """This config with n_sel bounded by the selection blocks of S keys (:meth:`sel_count`): the same
        outputs, with work and index tensors sized by the blocks that exist, not by n_sel."""
        k = self.sel_count(self.n_blocks(S))
        return self if k == self.n_sel else replace(self, n_sel=k)

    def rope_rule(self) -> str | None:
        """Why the layer (``NSAAttention``, which rotates queries and keys) cannot take this config, or None:
        RoPE rotates pairs of dims, so d_k must be even. The functional API has no RoPE and takes any d_k."""
        return "must be even for RoPE (it rotates pairs of dims)" if self.d_k % 2 else None

    def decode_tokens_formula(self, S: int) -> int:
        """Paper Table 4: key/value tokens read per decode step and group at context S."""
        return self.n_cmp(S) + min(self.n_sel * self.l_sel, S) + min(self.w, S)

    def to_dict(self) -> dict:
        """Returns: every field by name (``dataclasses.asdict``), e.g. to log or rebuild the config."""
        return asdict(self)
