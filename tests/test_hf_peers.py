"""A converted model in the libraries around transformers (the hf extra's peft and accelerate): PEFT LoRA on
NSA's projections trains only the adapters and merges back to the same logits; transformers.Trainer trains the
model on padded batches and its checkpoint loads back through the Auto class as NSA; sampling on NSA's cache
draws what recomputing the whole sequence draws."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it
peft = pytest.importorskip("peft")

from nsa.integrations import hf  # noqa: E402

SETTINGS = dict(l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1, gate_hidden=8)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101, pad_token_id=0)
X = torch.arange(1, 41).remainder(SHAPE["vocab_size"])[None]
# LoRA on the NSA layer's linear maps: queries, each branch's keys and values, the output
TARGETS = ["q_proj", "o_proj", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"]


def converted():
    torch.manual_seed(0)
    return hf.convert(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)), **SETTINGS)


def test_lora_trains_only_the_adapters_and_merges_to_the_same_logits():
    model = converted()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    adapters = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    wrapped = {n.split(".self_attn.nsa.")[1].rsplit(".lora_", 1)[0] for n in adapters}
    assert wrapped == {"q_proj", "o_proj", *(f"kv_proj.{k}" for k in TARGETS[2:])}
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        lora(X, labels=X).loss.backward()
        opt.step()
        opt.zero_grad()
    lora.eval()
    with torch.no_grad():
        want = lora(X).logits
        merged = lora.merge_and_unload()
        got = merged(X).logits
    assert (got - want).abs().max().item() <= 1e-5  # float32: the merged weight's rounding
    adapted = {n for n in before if ".self_attn.nsa." in n and n.rsplit(".", 2)[-2] in TARGETS}
    assert merged.state_dict().keys() == before.keys()
    for n, p in merged.named_parameters():  # the adapted weights moved; the norms, MLPs, phi and gates did not
        assert torch.equal(p, before[n]) != (n in adapted and n.endswith(".weight")), n


def test_trainer_trains_on_padded_batches_and_its_checkpoint_loads_as_nsa(tmp_path):
    model = converted()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g) for n in (30, 22, 26, 18)]
    data = [{"input_ids": r.tolist()} for r in rows]

    def pad(batch):  # right padding, labels -100 at the pads (what a tokenizer's collator gives)
        T = max(len(b["input_ids"]) for b in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, b in enumerate(batch):
            ids[i, :len(b["input_ids"])] = torch.tensor(b["input_ids"])
            mask[i, :len(b["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                          max_steps=4, learning_rate=1e-3, report_to=[], save_steps=4,
                                          logging_steps=1, use_cpu=True, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=pad)
    result = trainer.train()
    assert result.global_step == 4 and torch.isfinite(torch.tensor(result.training_loss))
    nsa = {n: p for n, p in model.named_parameters() if ".self_attn.nsa." in n}
    assert all(not torch.equal(p, before[n]) for n, p in nsa.items() if n.endswith("q_proj.weight"))
    ckpt = tmp_path / "out" / "checkpoint-4"
    back = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(back) is hf.NSALlamaForCausalLM
    model.eval()
    with torch.no_grad():
        assert torch.equal(back(X).logits, model(X).logits)


def test_sampling_on_the_cache_draws_what_recomputation_draws():
    """The same seed and the same logits at each step: top-k / top-p / temperature sampling with NSA's cache
    gives the tokens that recomputing the whole sequence at every step gives, past the prompt's length."""
    model = converted().eval()
    kw = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8, max_new_tokens=48, min_new_tokens=48)
    out = {}
    for use_cache in (True, False):
        torch.manual_seed(7)
        with torch.no_grad():
            out[use_cache] = model.generate(X, attention_mask=torch.ones_like(X), use_cache=use_cache, **kw)
    assert out[True].shape == (1, 88) and torch.equal(out[True], out[False])
