"""Padded batches in a converted transformers model (float64, reference backend): generate() of left-padded prompts
gives each row the tokens and logits of its own unpadded generation, greedy and with beams; a prompt that merely
holds the pad token id runs as transformers masks it (that token left out); the training forward of right-padded
rows (labels -100 at the pads) gives each row's unpadded logits and their loss; on the fused decode step
(interpreter, float32) a padded batch decodes as the module path does."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it

from nsa.backends.triton import triton_unsupported  # noqa: E402
from nsa.integrations import hf  # noqa: E402

F64 = torch.float64
SETTINGS = dict(l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1, gate_hidden=8)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101, pad_token_id=0, eos_token_id=None, bos_token_id=None)
ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)),
}
LENGTHS = (37, 22, 30)  # rows of unequal length: 15 and 7 pads in rows 1 and 2, over compressed blocks and the window
TOL = 1e-12
LOSS_TOL = 2e-6  # transformers' loss is float32 (it upcasts the logits): summation order over 86 tokens, relative;
# the 1e-15 beside it is for gradients that are 0 up to 1e-20 (phi_k.fc2.bias: the scores do not move with it)


def converted(arch: str, dtype=F64, **kw):
    torch.manual_seed(0)
    return hf.convert(ARCHS[arch]().to(dtype).eval(), **{**SETTINGS, **kw})


def prompts(lengths=LENGTHS, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g) for n in lengths]  # no pad id inside


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    x, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        at = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        x[b, at], mask[b, at] = r, 1
    return x, mask


def generate(model, x, mask, **kw):
    kw = {**dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                 return_dict_in_generate=True), **kw}
    with torch.no_grad():
        return model.generate(x, attention_mask=mask, **kw)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_left_padded_generate_equals_each_row_alone(arch):
    model = converted(arch)
    rows = prompts()
    x, mask = padded(rows, "left")
    out = generate(model, x, mask)
    T = x.shape[1]
    for b, r in enumerate(rows):
        alone = generate(model, r[None], torch.ones(1, len(r), dtype=torch.long))
        assert torch.equal(out.sequences[b, T:], alone.sequences[0, len(r):]), b
        for step, (a, want) in enumerate(zip(out.logits, alone.logits)):
            assert (a[b] - want[0]).abs().max().item() <= TOL, (b, step)
    cache = out.past_key_values.layers[0].nsa_cache
    assert cache.lengths.tolist() == [n + 11 for n in LENGTHS]  # each row's real tokens, not the padded width


def test_left_padded_beam_search_equals_each_row_alone():
    """Beams expand and reorder the ragged cache's rows (batch_repeat_interleave, reorder_cache)."""
    model = converted("llama")
    rows = prompts()
    x, mask = padded(rows, "left")
    out = generate(model, x, mask, num_beams=3, output_logits=False)
    for b, r in enumerate(rows):
        alone = generate(model, r[None], torch.ones(1, len(r), dtype=torch.long), num_beams=3, output_logits=False)
        assert torch.equal(out.sequences[b, x.shape[1]:], alone.sequences[0, len(r):]), b


def test_a_prompt_holding_the_pad_token_id_runs_without_that_token():
    """transformers builds the mask from pad_token_id when a prompt holds it (as a dense model's generate masks
    it): NSA then leaves that token out, as the dense model does, and decodes the rest."""
    model = converted("llama")
    (r,) = prompts((30,))
    with_pad = torch.cat([r[:9], torch.tensor([0]), r[9:]])[None]
    with torch.no_grad():
        got = model.generate(with_pad, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        want = model.generate(r[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(got[0, 31:], want[0, 30:])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_right_padded_training_forward_is_each_row_s_own(arch):
    """model(ids, attention_mask, labels) with labels -100 at the pads: each row's logits at its real tokens are
    its unpadded forward's, the loss is their token-weighted mean, and the gradients are those of that loss."""
    model = converted(arch).train()
    rows = prompts()
    x, mask = padded(rows, "right")
    labels = x.masked_fill(mask == 0, -100)
    out = model(x, attention_mask=mask, labels=labels)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total, n_tok = 0.0, 0
    for b, r in enumerate(rows):
        alone = model(r[None], labels=r[None])
        assert (out.logits[b, :len(r)] - alone.logits[0]).abs().max().item() <= TOL, b
        total, n_tok = total + alone.loss * (len(r) - 1), n_tok + len(r) - 1
    (total / n_tok).backward()
    assert abs(out.loss.item() - (total / n_tok).item()) <= LOSS_TOL
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert all((got[n] - want[n]).abs().max().item() <= LOSS_TOL * want[n].abs().max().item() + 1e-15 for n in want)


@pytest.mark.skipif(triton_unsupported() is not None, reason=triton_unsupported() or "")
@pytest.mark.usefixtures("fast_interpreter")
@pytest.mark.parametrize("decode", ["step", "model_step"])
def test_left_padded_generate_on_the_fused_decode_step_equals_the_module_path(decode):
    """The ragged cache of a padded prompt under GraphDecoder's step, each layer's or the whole model's (Triton
    through the interpreter, float32)."""
    step = converted("qwen2", torch.float32, backend="triton", decode=decode)
    ref = converted("qwen2", torch.float32, decode="module")
    step.load_state_dict(ref.state_dict())
    x, mask = padded(prompts(), "left")
    a, b = generate(step, x, mask), generate(ref, x, mask)
    assert torch.equal(a.sequences, b.sequences)
    assert max((p - q).abs().max().item() for p, q in zip(a.logits, b.logits)) <= 1e-4
    assert {m.decode_ran for m in step.modules() if isinstance(m, hf.NSASelfAttention)} == {decode}
