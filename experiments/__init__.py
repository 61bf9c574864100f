"""Hydra + MLflow entry points: ``python -m experiments.decode | prefill | parity`` (configs in conf/)."""
