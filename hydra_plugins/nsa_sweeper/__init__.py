"""nsa-bench's Hydra sweeper (``hydra/sweeper: nsa``); the sweep itself is experiments.framework.sweep."""
