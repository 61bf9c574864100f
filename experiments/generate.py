"""``model.generate()`` of a transformers causal LM, NSA (``nsa.integrations.hf.convert``) against the same model
dense (SDPA): the prompt's prefill time and the decode tokens/s, and a token check of the NSA model.

    python -m experiments.generate hardware=h100 backend=triton -m seq=8192,16384,32768,65536 attention=nsa,dense

On a CPU, at a tiny shape: ``--help``'s example.

The model (``generate.lm``: llama, qwen2 or mistral, random init, built offline on the device in the run's dtype)
takes its attention shape from ``model.nsa`` (``dim`` = hidden_size, heads, key/value heads, ``d_k`` = ``d_v`` =
head_dim, ``rope_base`` = rope_theta) and its body from ``generate.lm`` (layers, MLP width, vocabulary);
``attention=nsa`` converts it with the rest of ``model.nsa`` as the NSA settings, on the run's backend plan, each
new token run as ``generate.decode`` says (``nsa.integrations.hf.DECODE``; ``auto``: one CUDA graph of the whole
model's decode step on a GPU, the layer's own cached forward on a CPU; tag ``decode_ran``);
``attention=dense`` runs it as transformers has it (SDPA, its DynamicCache). The prompt: ``seq`` random token ids
(``generate.batch`` rows); ``generate.new_tokens`` tokens greedy (``min_new_tokens`` = ``max_new_tokens``). An NSA
model's cache (one ``NSACache`` per layer) is made for prompt + new tokens before the calls, so no step grows it,
and reset between them. A clock at each step (a stopping criterion that synchronizes the device, then reads the
time) gives the prefill (from the call to the first token: every layer's prefill of the prompt, the head, the
first argmax) and each decode step (one token through every layer); ``generate.warmup`` untimed calls of the same
length first (Triton's compilation, the CUDA graphs' capture).

``generate.check_tokens`` (NSA only): on a prompt of ``generate.check_prompt`` tokens, ``generate.check_new_tokens``
greedy tokens of the NSA model on the run's backends against the same weights on backend=reference, both in
``generate.check_dtype`` (float32: kernel rounding then rarely flips a greedy near-tie): metric ``tokens_equal``
(1 or 0), ``max_logit_diff`` (over the steps up to the first differing token); a difference fails the run.
"""
from __future__ import annotations

import inspect
import logging
import time

import hydra
import torch
from omegaconf import DictConfig

from nsa.numerics import DTYPES

from .framework import Charts, Job, Result, check_memory, launch, run_job

log = logging.getLogger("experiments.generate")
ARCHS = ("llama", "qwen2", "mistral")
KINDS = ("nsa", "dense")
# hf.DECODE, checked without the hf extra
DECODE = ("auto", "model_graph", "model_compiled", "model_step", "graph", "step", "module")
DECODE_SAYS = {"model_graph": "one CUDA graph of the whole model's decode step (nsa.integrations.hf_graph.ModelStep)",
               "model_compiled": "one CUDA graph of the whole model's decode step, transformers' part compiled by "
                                 "torch.compile first (nsa.integrations.hf_graph)",
               "model_step": "the whole model's decode step eager, each layer's the fused decode kernels",
               "graph": "one CUDA graph of the fused decode step per layer (GraphDecoder.replay)",
               "step": "the fused decode kernels, eager (GraphDecoder.step)",
               "module": "the layer's own cached forward (NSAAttention.forward(x_t, cache))"}


def check_config(job: Job) -> None:
    """generate's rules (``run_job``'s and ``launch``'s ``check``: a ValueError is a config error, one line, exit 2,
    no run)."""
    g, c = job.cfg.generate, job.nsa
    kind = job.cfg.attention.kind
    if kind not in KINDS:
        raise ValueError(f"attention={kind}: experiments.generate runs attention=nsa or attention=dense")
    for key in ("batch", "new_tokens", "check_prompt", "check_new_tokens", "lm.n_layers", "lm.mlp_hidden", "lm.vocab"):
        v = g.lm[key[3:]] if key.startswith("lm.") else g[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"generate.{key}={v!r}: must be an integer >= 1")
    if not isinstance(g.warmup, int) or isinstance(g.warmup, bool) or g.warmup < 0:
        raise ValueError(f"generate.warmup={g.warmup!r}: must be an integer >= 0")
    if g.decode not in DECODE:
        raise ValueError(f"generate.decode={g.decode!r}: one of {', '.join(DECODE)}")
    if not isinstance(g.check_tokens, bool):
        raise ValueError(f"generate.check_tokens={g.check_tokens!r}: must be true or false")
    if g.check_dtype not in DTYPES:
        raise ValueError(f"generate.check_dtype={g.check_dtype!r}: one of {', '.join(DTYPES)}")
    if g.lm.arch not in ARCHS:
        raise ValueError(f"generate.lm.arch={g.lm.arch!r}: one of {', '.join(ARCHS)}")
    if c.d_k != c.d_v:
        raise ValueError(f"model.nsa.d_v={c.d_v}: a transformers model has one head_dim, d_v = d_k = {c.d_k}")
    if c.qkv_bias or c.o_bias:
        raise ValueError("model.nsa.qkv_bias/o_bias: the projection biases are the architecture's (generate.lm.arch)")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ValueError(f"experiments.generate: needs the [hf] extra (pip install -e \".[hf]\"): {e}") from e


def hf_config(job: Job, max_positions: int):
    """The transformers config of ``generate.lm.arch`` at model.nsa's attention shape and generate.lm's body."""
    import transformers

    c, lm = job.nsa, job.cfg.generate.lm
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[lm.arch]
    extra = {"sliding_window": None} if lm.arch == "mistral" else {}  # full attention, as NSA's comparison
    return cls(hidden_size=c.dim, intermediate_size=lm.mlp_hidden, num_hidden_layers=lm.n_layers,
               num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.d_k, vocab_size=lm.vocab,
               tie_word_embeddings=bool(lm.tie_embeddings), max_position_embeddings=max_positions,
               rope_parameters={"rope_type": "default", "rope_theta": c.rope_base}, **extra)


def nsa_settings(job: Job) -> dict:
    """model.nsa's NSA settings (the fields the transformers model does not fix)."""
    from nsa.integrations import hf

    return {k: v for k, v in job.nsa.to_dict().items() if k in hf.SETTINGS}


def build(job: Job, kind: str, dtype: torch.dtype, backend, max_positions: int):
    """The model at random init (seeded by ``seed``), on the job's device in ``dtype``, NSA converted on
    ``backend`` or dense (SDPA); eval mode."""
    import transformers

    from nsa.integrations import hf

    torch.manual_seed(int(job.cfg.seed))
    with torch.device(job.device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(job, max_positions), dtype=dtype,
                                                              attn_implementation="sdpa")
    if kind == "nsa":
        hf.convert(model, backend=backend, fallback=job.fallback, streams=bool(job.cfg.streams),
                   decode=str(job.cfg.generate.decode), **nsa_settings(job))
    return model.eval()


def nsa_cache(model, batch: int, max_len: int):
    """A transformers DynamicCache whose every layer holds an empty NSACache of ``max_len`` tokens."""
    from transformers import DynamicCache

    from nsa.integrations import hf

    cache = DynamicCache()
    for i, layer in enumerate(model.base_model.layers):
        slot = hf.cache_layer(cache, i)
        slot.nsa_cache, slot.is_initialized = layer.self_attn.nsa.new_cache(batch, max_len), True
    return cache


def cache_bytes(cache) -> int:
    from nsa.integrations import hf

    return sum(getattr(s.nsa_cache, b).nbytes for s in cache.layers for b in hf.BUFFERS)


class Clock:
    """A stopping criterion that never stops: at each generated token, the device synchronized, the time."""

    def __init__(self, device: torch.device):
        self.device, self.t = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def greedy(model, prompt, new: int, cache=None, clock: Clock | None = None, logits: bool = False):
    """``model.generate`` greedy, exactly ``new`` tokens; (the output, the time at the call)."""
    from transformers import StoppingCriteriaList

    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=model.config.eos_token_id, return_dict_in_generate=True, output_logits=logits)
    if cache is not None:  # transformers 5.24 renamed generate's past_key_values to cache
        kw["cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"] = cache
    if clock is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([clock])
    if prompt.device.type == "cuda":
        torch.cuda.synchronize(prompt.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        return model.generate(prompt, **kw), t0


def compare_tokens(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Generated tokens ``got`` against ``want`` ([B, N] each): equal, the first differing step (-1: none), how
    many differ."""
    if got.shape != want.shape:
        raise ValueError(f"compare_tokens: shapes {tuple(got.shape)} and {tuple(want.shape)} differ")
    diff = (got != want).any(0)
    first = int(diff.nonzero()[0, 0]) if bool(diff.any()) else -1
    return {"equal": first < 0, "first_mismatch": first, "n_mismatch": int((got != want).sum())}


def token_check(job: Job) -> tuple[dict, dict, str | None]:
    """(metrics, tags, failure) of generate.check_tokens: the NSA model on the job's backends against the same
    weights on backend=reference, in generate.check_dtype, greedy on a random prompt."""
    g = job.cfg.generate
    dt, P, N = DTYPES[g.check_dtype], int(g.check_prompt), int(g.check_new_tokens)
    model = build(job, "nsa", dt, job.plan, P + N)
    ref = build(job, "nsa", dt, "reference", P + N)
    ref.load_state_dict(model.state_dict())
    prompt = torch.randint(0, int(g.lm.vocab), (int(g.batch), P), device=job.device,
                           generator=torch.Generator(job.device).manual_seed(int(job.cfg.seed) + 1))
    got, _ = greedy(model, prompt, N, logits=True)
    want, _ = greedy(ref, prompt, N, logits=True)
    cmp = compare_tokens(got.sequences[:, P:], want.sequences[:, P:])
    upto = N if cmp["equal"] else cmp["first_mismatch"] + 1  # past a differing token the inputs differ
    max_diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got.logits[:upto], want.logits[:upto]))
    metrics = {"tokens_equal": float(cmp["equal"]), "max_logit_diff": max_diff, "tokens_differing": cmp["n_mismatch"]}
    what = (f"{N} greedy tokens after a {P}-token prompt, {g.check_dtype}, backends {job.plan} against reference")
    if cmp["equal"]:
        return metrics, {"token_check": f"equal: {what}; max logit difference {max_diff:.3g}"}, None
    top2 = want.logits[cmp["first_mismatch"]].double().topk(2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())
    metrics["ref_top2_gap_at_mismatch"] = gap
    failure = (f"token check: the tokens DIFFER from step {cmp['first_mismatch']} on ({cmp['n_mismatch']} of "
               f"{got.sequences[:, P:].numel()}): {what}; max logit difference {max_diff:.3g} up to there, the "
               f"reference's top-2 gap there {gap:.3g}")
    return metrics, {"token_check": failure}, failure


def estimate_bytes(job: Job) -> float:
    """The job's tensors, bounded from above: the weights (NSA's three key/value pairs per layer), the cache
    (NSA's three branches' raw keys/values and the compressed ones; dense: keys/values twice, DynamicCache's
    concatenation), one layer's prefill activations over the prompt, and the token check's two float32 models."""
    c, g = job.nsa, job.cfg.generate
    lm, B, S, N, it = g.lm, int(g.batch), job.seq, int(g.new_tokens), job.dtype.itemsize
    L, D, I, V, hd = lm.n_layers, c.dim, lm.mlp_hidden, lm.vocab, c.d_k
    nsa = job.cfg.attention.kind == "nsa"
    kv = c.n_kv_heads * hd * 2 * (3 if nsa else 1)
    per_layer = D * (c.n_heads * hd) * 2 + D * kv + 3 * D * I + 2 * D + (D * D if nsa else 0)  # + phi, gates (bound)
    params = L * per_layer + V * D * (1 if lm.tie_embeddings else 2)
    T = S + N
    cache = L * B * T * kv * it * (1 if nsa else 2)
    act = B * S * (8 * D + 4 * I + 4 * c.n_heads * hd + 4 * kv) * it + B * V * 4
    check = 2 * params * DTYPES[g.check_dtype].itemsize if nsa and g.check_tokens else 0
    return float(params * it + cache + act + check)


def check_fits(job: Job) -> None:
    check_memory(job, estimate_bytes(job))


def work(job: Job) -> Result:
    check_fits(job)
    g, S, dev = job.cfg.generate, job.seq, job.device
    kind, B, N = job.cfg.attention.kind, int(g.batch), int(g.new_tokens)
    model = build(job, kind, job.dtype, job.plan, S + N)
    params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, int(g.lm.vocab), (B, S), device=dev,
                           generator=torch.Generator(dev).manual_seed(int(job.cfg.seed) + 1))

    cache = nsa_cache(model, B, S + N) if kind == "nsa" else None  # reset before each call, never grown

    def fresh():
        if cache is not None:
            cache.reset()
        return cache

    for _ in range(int(g.warmup)):
        greedy(model, prompt, N, fresh())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    clock = Clock(dev)
    out, t0 = greedy(model, prompt, N, fresh(), clock)
    assert out.sequences.shape == (B, S + N) and len(clock.t) == N, (tuple(out.sequences.shape), len(clock.t))
    if kind == "nsa":  # the cache made here took the prompt and every token but the last, and never grew
        c0 = cache.layers[0].nsa_cache
        assert (c0.length, c0.max_len) == (S + N - 1, S + N), (c0.length, c0.max_len)
    steps = [b - a for a, b in zip(clock.t, clock.t[1:])]
    prefill_s = clock.t[0] - t0
    metrics = {"params_m": params / 1e6, "generated_tokens": float(N)}
    headline = {"prefill_s": prefill_s, "prefill_tokens_per_s": B * S / prefill_s}
    if steps:
        headline["decode_tokens_per_s"] = B * len(steps) / (clock.t[-1] - clock.t[0])
        headline["decode_step_p50_ms"] = 1e3 * sorted(steps)[len(steps) // 2]
    if kind == "nsa":
        metrics["nsa_cache_gib"] = cache_bytes(cache) / 2**30
    if dev.type == "cuda":
        headline["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30  # the timed call's
    metrics["est_mem_gib"] = estimate_bytes(job) / 2**30
    ran = sorted({str(layer.self_attn.decode_ran) for layer in model.base_model.layers}) if kind == "nsa" else []
    tags = {"attention": kind, "arch": g.lm.arch, **({"decode_ran": ",".join(ran)} if ran else {}),
            "generate_timed": "prefill_s: generate() call to the first token; decode: each later token through every "
                              "layer (device synchronized at each token)" + (
                                  "; dense: transformers' DynamicCache" if kind == "dense" else
                                  f"; NSA: an NSACache per layer sized for prompt + new tokens, each token "
                                  f"{DECODE_SAYS.get(','.join(ran), ','.join(ran))}")}
    log.info(f"[generate] seq={S} {kind}: {params / 1e6:.0f}M params, prefill {prefill_s:.3f} s"
             + (f", decode {headline['decode_tokens_per_s']:.1f} tokens/s" if steps else ""))
    model = cache = out = None  # freed before the check builds its two models
    failure = None
    if kind == "nsa" and g.check_tokens:
        m, t, failure = token_check(job)
        metrics.update(m)
        tags.update(t)
        log.info(f"[generate] {t['token_check']}")
    row = {"seq_tokens": S, "attention": kind, "batch_seqs": B, "new_tokens": N, "arch": g.lm.arch,
           "dtype": str(job.dtype).replace("torch.", ""), **headline, **metrics}
    charts = Charts("seq_tokens", "attention", tuple(k for k in ("prefill_s", "decode_tokens_per_s") if k in headline))
    return Result([row], metrics, headline=headline, failure=failure, charts=charts, tags=tags)


@hydra.main(config_path="../conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "generate", work, fits=check_fits, check=check_config)


if __name__ == "__main__":
    launch(main, "generate", check=check_config)
