"""Config nodes that this project's entry points compose and a yaml file cannot express, registered when
Hydra scans ``hydra_plugins`` (at every initialization, whatever was imported first).

Resolver ``nsa_gpus_per_node`` (:func:`gpus_per_node`), which ``conf/hydra/launcher/slurm.yaml`` (and so
``per_gpu``) names: here, so that any Hydra app composing those launcher configs resolves it.

Group ``tuning`` (option ``none``: no overrides), which kernels.yaml and prefill.yaml list in their defaults:
a node without OmegaConf's struct flag, so ``tuning.<op>.<key>=...`` needs no "+"
(experiments.framework.config.check_tuning checks the keys ``nsa.backends.triton.tuning.KEYS`` has)."""
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

_tuning = OmegaConf.create({})
OmegaConf.set_struct(_tuning, False)
ConfigStore.instance().store(group="tuning", name="none", node=_tuning)


def gpus_per_node(gpus_per_task, tasks_per_node) -> int | None:
    """A SLURM job's GPUs per host: the hardware profile's GPUs of one rank times the ranks per host (null where
    the profile leaves it to the cluster)."""
    return None if gpus_per_task is None else int(gpus_per_task) * int(tasks_per_node)


if not OmegaConf.has_resolver("nsa_gpus_per_node"):
    OmegaConf.register_new_resolver("nsa_gpus_per_node", gpus_per_node)
