"""The one place where the library reads environment variables.

* ``TRITON_INTERPRET`` (:func:`triton_interpret`): ``1`` runs Triton kernels on CPU tensors through
  Triton's interpreter. Set it before ``import triton``; CI does, for kernel tests at small shapes.

Everything else reaches the library as explicit arguments, filled from Hydra configs; the experiments' own
variables (the tracking store, SLURM's job, the GPUs a scheduler gives) are read in ``experiments/env.py``.
"""

from __future__ import annotations

import os


def triton_interpret() -> bool:
    """Returns: whether ``TRITON_INTERPRET`` is set (to anything but empty or 0): Triton kernels then run
    on the CPU through the interpreter.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
