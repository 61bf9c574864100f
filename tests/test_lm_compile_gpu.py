"""``train.compile`` on a CUDA GPU: the training steps of ``train=needles32k``'s model (lm=small,
NSA on the triton kernels, bf16 autocast) compiled by inductor, with and without CUDA graphs, give the eager
run's losses. Same seed, same data: the runs differ only by rounding (inductor fuses the elementwise work
around the kernels and rounds bf16 intermediates its own way, tests/test_compile_gpu.py), so each logged
loss and mean gate (each a mean over 2 steps) stays within 2e-2 of eager's, relative; a compiled graph that
dropped a branch, the gates' hooks or the switch from held to free gates would move them by far more.

Marked ``gpu`` (tests/conftest.py deselects it without CUDA); the loop's plumbing is tested on the CPU in
tests/test_lm_loop.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.lm.config import RunConfig
from experiments.lm.loop import train
from nsa import env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(env.triton_interpret(), reason="TRITON_INTERPRET=1 interprets the kernels; this test "
                                                      "compiles the bf16 training step"),
]

CONF = Path(__file__).resolve().parent.parent / "conf"
SHORT = ["train=needles32k", "train.curriculum=[]", "data.seq_len=2048", "data.gap=512", "train.batch=4",
         "train.steps=6", "train.log_every=2", "train.eval_every=6", "train.ckpt_every=6", "train.eval_batches=1",
         "train.warmup=2", "train.gates_open_steps=3"]


def _logged(tmp, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = RunConfig.from_conf(compose("train", [*SHORT, *overrides]), dtype="bfloat16")
    logged = []
    torch._dynamo.reset()
    out = train(cfg, device=torch.device("cuda"), log=lambda m, s: logged.append(m), ckpt_dir=tmp, run_id="r")
    assert out["completed"] and len(logged) == 3
    return logged


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_steps_give_the_eager_losses(tmp_path, mode):
    eager = _logged(tmp_path / "eager")
    compiled = _logged(tmp_path / mode, f"train.compile={mode}")
    for key in ("loss", "gate_sel", "gate_cmp"):  # the gate means come from hooks inside the compiled graph
        a, b = [m[key] for m in compiled], [m[key] for m in eager]
        assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= 2e-2, (mode, key, eager, compiled)
    # steps 1-2 held the gates at 1, steps 4-6 ran them free: the compiled graph followed the switch
    assert compiled[0]["gate_sel"] == 1.0 and compiled[2]["gate_sel"] < 0.999 and compiled[2]["val_loss"] > 0
