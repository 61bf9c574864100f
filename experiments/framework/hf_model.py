"""``model.hf_path``: the layer's NSAConfig from a Hugging Face transformers model's folder (docs/hf.md).

A folder with a transformers ``config.json`` (Llama, Qwen2, Mistral: a dense model's, or one saved after
``nsa.integrations.hf.convert``) gives the NSAConfig its converted model's layers have: the fields the model
fixes (``hf.FROM_MODEL``: width, heads, head_dim, biases, rope_theta) from the architecture, built on the meta
device (nothing allocated), and the NSA settings (``hf.SETTINGS``) from the config's ``nsa`` dict where it has
one (a converted model's), else from ``model.nsa``. The folder wins over ``model.nsa``: a field it sets
differently is replaced, and the run records each replacement (param ``model.hf_replaced``), with the resolved
path (``model.hf_path``), the architecture (``model.hf_arch``) and the folder's name as ``model.name``.
``model=`` still gives the batch and the timing repeats.
"""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

import nsa

from .errors import ConfigError

KEY = "model.hf_path"
# Entry points whose layer is job.nsa alone (generate builds its transformers model from generate.lm; validate
# loads its own model presets per size): the others refuse model.hf_path rather than ignore it.
ENTRIES = ("decode", "prefill", "parity", "kernels")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _settings_node(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg.model.nsa, resolve=True) if "nsa" in cfg.model else {}


def nsa_config(cfg: DictConfig, entry: str) -> nsa.NSAConfig:
    """The NSAConfig of the converted model in ``cfg.model.hf_path``; ``cfg.model`` is rewritten to say what
    runs (``nsa``: the config's fields; ``hf_path`` resolved; ``hf_arch``, ``hf_replaced``, ``name``), so the
    run's params record it. A ConfigError (one line naming model.hf_path) where the folder cannot give one."""
    where = f"{KEY}={cfg.model.hf_path}"
    if entry not in ENTRIES:
        raise ConfigError(f"{where}: experiments.{entry} does not take it (it builds its model from its own config, "
                          f"not a folder's); model.hf_path is for experiments.{', experiments.'.join(ENTRIES)}")
    path = Path(str(cfg.model.hf_path)).expanduser().absolute()
    if not path.is_dir():
        raise ConfigError(f"{where}: no such folder ({path}); a folder with a transformers config.json")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: no config.json in {path} (a transformers model's save_pretrained folder)")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        from nsa.integrations import hf
    except ImportError as e:
        raise ConfigError(f"{where}: needs transformers, the [hf] extra (pip install -e \".[hf]\"): "
                          f"{_one_line(e)}") from e
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (a user's file: transformers' checks raise many kinds, all one line here)
        raise ConfigError(f"{where}: config.json: {type(e).__name__}: {_one_line(e)}") from e
    config, saved = hf.dense_config(config)  # an NSA model type's: its dense architecture and settings
    arch = getattr(config, "model_type", None)
    if arch not in hf.ARCHITECTURES:
        raise ConfigError(f"{where}: architecture {arch!r} is not supported; supported: {', '.join(hf.ARCHITECTURES)}")
    _check_sizes(config, where)
    ours = _settings_node(cfg)
    if saved is not None and not isinstance(saved, dict):
        raise ConfigError(f"{where}: config.json's nsa={saved!r}: must be a dict of NSA settings")
    settings = dict(saved) if saved is not None else {k: v for k, v in ours.items() if k in hf.SETTINGS}
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        ncfg = hf.nsa_config(model, **settings)
    except (ValueError, TypeError) as e:
        src = "config.json's nsa" if saved is not None else "model.nsa"
        raise ConfigError(f"{where}: {_one_line(e).removeprefix('convert: ')} (NSA settings from {src})") from e
    got = ncfg.to_dict()
    if got["gate_bias"] is not None:
        got["gate_bias"] = list(got["gate_bias"])
    replaced = [f"{k}={ours[k]!r}->{got[k]!r}" for k in got if k in ours and _differs(ours[k], got[k])]
    cfg.model.nsa = got
    cfg.model.hf_path = str(path)
    cfg.model.hf_arch = arch
    cfg.model.hf_replaced = " ".join(replaced) or "none"
    cfg.model.name = path.name
    return ncfg


# config.json's sizes, checked before the model is built on the meta device: building loops over the layers
# (the largest public dense models have about 130), and a zero or a non-integer fails inside transformers.
SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
         "vocab_size", "head_dim")
MAX_LAYERS = 1024


def _check_sizes(config, where: str) -> None:
    """A ConfigError naming the first of config.json's SIZES that is not a positive integer (num_hidden_layers at
    most MAX_LAYERS); head_dim may be absent or null (hidden_size / num_attention_heads)."""
    for key in SIZES:
        v = getattr(config, key, None)
        if key == "head_dim" and v is None:
            continue
        top = MAX_LAYERS if key == "num_hidden_layers" else None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (top is not None and v > top):
            rule = f"an integer from 1 to {top}" if top else "an integer >= 1"
            raise ConfigError(f"{where}: config.json's {key}={v!r}: must be {rule}")


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) != list(b)
    return a != b
