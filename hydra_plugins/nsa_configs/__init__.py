"""Config nodes that this project's entry points compose and a yaml file cannot express, registered when
Hydra scans ``hydra_plugins`` (at every initialization, whatever was imported first).

Group ``tuning`` (option ``none``: no overrides), which kernels.yaml and prefill.yaml list in their defaults:
a node without OmegaConf's struct flag, so ``tuning.<op>.<key>=...`` needs no "+"
(experiments.framework.config.check_tuning checks the keys ``nsa.backends.triton.tuning.KEYS`` has)."""
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

_tuning = OmegaConf.create({})
OmegaConf.set_struct(_tuning, False)
ConfigStore.instance().store(group="tuning", name="none", node=_tuning)
