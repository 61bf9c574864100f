"""nsa-bench's Hydra launcher for one host's GPUs without a scheduler (``hydra/launcher: local_gpus``)."""
