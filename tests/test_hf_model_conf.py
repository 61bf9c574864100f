"""``model.hf_path`` (experiments/framework/hf_model.py) through the real command line on the CPU: decode and
prefill time the NSA layer of a transformers model's folder (its heads, head_dim, biases, rope_theta; the NSA
settings a converted model was saved with), the run records what ran and what the folder replaced, and a folder
that cannot give a layer is one line naming model.hf_path, exit 2, no run. docs/hf.md's commands run as written
with ``<folder>`` a tiny Qwen2 config."""
from __future__ import annotations

import json
import re

import entrypoints
import pytest

pytest.importorskip("transformers")  # the [hf] extra

import transformers  # noqa: E402

from nsa.integrations import hf  # noqa: E402

# Shapes unlike model=tiny's (dim 64, 4 heads on 2, head_dim 16, rope_base 10000), so the folder's must show.
QWEN2 = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
             intermediate_size=128, vocab_size=64, rope_theta=50000.0)
LLAMA = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=1,
             intermediate_size=128, vocab_size=64, rope_theta=20000.0)
SAVED = dict(l=8, d=4, l_sel=8, n_sel=3, w=16)  # a converted model's settings, unlike tiny's (16, 8, 16, 4, 32)


def save_config(folder, cls, **kw):
    cls(**kw).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    import torch

    torch.manual_seed(0)
    converted = hf.convert(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), **SAVED)
    converted.save_pretrained(root / "converted")
    (root / "empty").mkdir()
    scaled = dict(LLAMA, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    bogus = transformers.LlamaConfig(**LLAMA)
    bogus.nsa = {"l": 8, "bogus": 1}  # a hand-edited nsa
    bogus.save_pretrained(root / "bogus")
    for name, key, value in [("deep", "num_hidden_layers", 10**9), ("no_kv_heads", "num_key_value_heads", 0),
                             ("zero_heads", "num_attention_heads", 0)]:  # hand-edited sizes
        f = save_config(root / name, transformers.LlamaConfig, **LLAMA) / "config.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), key: value}))
    return {"qwen2": save_config(root / "qwen2", transformers.Qwen2Config, **QWEN2),
            "llama": save_config(root / "llama", transformers.LlamaConfig, **LLAMA),
            "converted": root / "converted",
            "gpt2": save_config(root / "gpt2", transformers.GPT2Config, n_embd=64, n_layer=1, n_head=2),
            "empty": root / "empty", "missing": root / "nope", "bogus": root / "bogus",
            "scaled": save_config(root / "scaled", transformers.LlamaConfig, **scaled),
            **{n: root / n for n in ("deep", "no_kv_heads", "zero_heads")}}


def documented() -> list[str]:
    """docs/hf.md's commands with ``model.hf_path=<folder>`` (the harness of documented commands leaves out
    those with a placeholder: this module runs them)."""
    text = (entrypoints.REPO / "docs" / "hf.md").read_text()
    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("python -m experiments.") and "model.hf_path=<folder>" in ln]


CPU_ARGS = {  # name: (entry, the folder, arguments besides model.hf_path)
    "decode_qwen2": ("decode", "qwen2", ["hardware=cpu", "model=tiny", "seq=64"]),
    "prefill_llama": ("prefill", "llama", ["hardware=cpu", "model=tiny", "seq=48", "prefill.backward=false"]),
    "decode_converted": ("decode", "converted", ["hardware=cpu", "seq=64", "model.nsa.n_sel=5"]),
}
ERRORS = {  # name: (entry, the folder or None for the shim's case, the texts of the one line)
    "missing": ("decode", "missing", ["no such folder"]),
    "empty": ("prefill", "empty", ["no config.json in"]),
    "gpt2": ("decode", "gpt2", ["architecture 'gpt2' is not supported; supported: llama, qwen2, mistral"]),
    "scaled": ("decode", "scaled", ["rope_type='linear'", "plain RoPE", "(NSA settings from model.nsa)"]),
    "bogus": ("prefill", "bogus", ["unknown NSA setting 'bogus'", "(NSA settings from config.json's nsa)"]),
    "no_transformers": ("decode", "qwen2", ["needs transformers, the [hf] extra"]),
    "generate": ("generate", "qwen2", ["experiments.generate does not take it"]),
    # sizes read from the file, checked before the model is built (a billion layers would be built one by one)
    "deep": ("decode", "deep", ["config.json's num_hidden_layers=1000000000: must be an integer from 1 to 1024"]),
    "no_kv_heads": ("prefill", "no_kv_heads", ["config.json's num_key_value_heads=0: must be an integer >= 1"]),
    "zero_heads": ("decode", "zero_heads", ["config.json: ZeroDivisionError"]),
}


@pytest.fixture(scope="module")
def cli(folders, tmp_path_factory):
    """Every run of this module, at most one per core at a time: name -> (tmp, rc, out, err)."""
    launches, dirs = {}, {}
    shim = tmp_path_factory.mktemp("shim")  # `import transformers` fails, as where the extra is not installed
    (shim / "transformers").mkdir()
    (shim / "transformers" / "__init__.py").write_text("raise ImportError(\"No module named 'transformers'\")\n")

    def add(name, entry, args, extra_env=None):
        dirs[name] = tmp = tmp_path_factory.mktemp(name)
        launches[name] = lambda: entrypoints.start(tmp, entry, *args, extra_env=extra_env)

    for name, (entry, folder, args) in CPU_ARGS.items():
        add(name, entry, [*args, f"model.hf_path={folders[folder]}"])
    for name, (entry, folder, _) in ERRORS.items():
        env = {"PYTHONPATH": f"{entrypoints.REPO}:{shim}"} if name == "no_transformers" else None
        add("error_" + name, entry, ["hardware=cpu", f"model.hf_path={folders[folder]}"], env)
    for i, cmd in enumerate(documented()):
        args = cmd.replace("<folder>", str(folders["qwen2"])).split()[2:]
        add(f"doc{i}", args[0].split(".")[1], args[1:])
    done = entrypoints.run_bounded(launches)
    return {n: (dirs[n], *done[n][:3]) for n in launches}


def params(tmp, entry):
    _, runs = entrypoints.runs(tmp / "mlflow.db", entry)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", [(r.info.status, r.data.tags.get("error")) for r in runs]
    return runs[0].data.params, runs[0].info.run_name


def test_decode_times_a_qwen2_folders_attention(cli, folders):
    tmp, rc, out, err = cli["decode_qwen2"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    p, name = params(tmp, "decode")
    assert (p["model.nsa.dim"], p["model.nsa.n_heads"], p["model.nsa.n_kv_heads"]) == ("96", "6", "2")
    assert (p["model.nsa.d_k"], p["model.nsa.d_v"], p["model.nsa.rope_base"]) == ("16", "16", "50000.0")
    assert (p["model.nsa.qkv_bias"], p["model.nsa.o_bias"]) == ("True", "False")  # Qwen2's q/k/v biases
    assert p["model.nsa.n_sel"] == "4" and p["model.nsa.l"] == "16"  # no nsa in its config: model=tiny's settings
    assert p["model.hf_path"] == str(folders["qwen2"]) and p["model.hf_arch"] == "qwen2"
    assert p["model.hf_replaced"] == "dim=64->96 n_heads=4->6 rope_base=10000.0->50000.0"
    assert p["model.name"] == "qwen2" and " qwen2 " in name


def test_prefill_times_a_llama_folders_attention(cli, folders):
    tmp, rc, out, err = cli["prefill_llama"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    p, _ = params(tmp, "prefill")
    assert (p["model.nsa.dim"], p["model.nsa.n_heads"], p["model.nsa.n_kv_heads"]) == ("64", "2", "1")
    assert (p["model.nsa.d_k"], p["model.nsa.d_v"], p["model.nsa.rope_base"]) == ("32", "32", "20000.0")
    assert (p["model.nsa.qkv_bias"], p["model.nsa.o_bias"]) == ("False", "False")
    assert p["model.hf_arch"] == "llama" and p["seq"] == "48"


def test_a_converted_folder_carries_its_nsa_settings(cli, folders):
    """Its config.json's nsa wins over model.nsa (the preset's and the command line's n_sel=5), recorded."""
    tmp, rc, out, err = cli["decode_converted"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    p, _ = params(tmp, "decode")
    assert {k: p[f"model.nsa.{k}"] for k in SAVED} == {k: str(v) for k, v in SAVED.items()}
    assert p["model.nsa.n_heads"] == "2" and p["model.nsa.d_k"] == "32" and p["model.hf_arch"] == "llama"
    assert "n_sel=5->3" in p["model.hf_replaced"] and "l=16->8" in p["model.hf_replaced"]


@pytest.mark.parametrize("case", ERRORS)
def test_a_folder_that_gives_no_layer_is_one_line_and_no_run(cli, folders, case):
    tmp, rc, out, err = cli["error_" + case]
    lines = entrypoints.one_line(err)
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"config error: model.hf_path={folders[ERRORS[case][1]]}: "), lines[0]
    assert all(s in lines[0] for s in ERRORS[case][2]), lines[0]
    assert not (tmp / "mlflow.db").exists() and not (tmp / "out").exists()


def test_the_documented_commands_run_with_a_folder(cli):
    docs = documented()
    assert {c.split()[2] for c in docs} == {"experiments.decode", "experiments.prefill"}
    assert any("hardware=cpu" in c for c in docs) and any("hardware=cpu" not in c for c in docs)
    for i, cmd in enumerate(docs):
        tmp, rc, out, err = cli[f"doc{i}"]
        if "hardware=cpu" in cmd:
            assert rc == 0 and "Traceback" not in err, (cmd, err[-3000:])
            p, _ = params(tmp, cmd.split()[2].split(".")[1])
            assert p["model.nsa.n_heads"] == "6" and p["model.nsa.qkv_bias"] == "True"
        else:  # a GPU's command on this CPU: refused before anything starts
            lines = entrypoints.one_line(err)
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error:"), (cmd, err[-2000:])

