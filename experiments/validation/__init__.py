"""``python -m experiments.validate``: does this NSA build work on this device, and how fast is it here.

One module per check, each ``run(ctx: core.Context) -> core.Check``: :mod:`.environment` (``env``),
:mod:`.kernels`, :mod:`.decode_breakdown` (``decode``), :mod:`.prefill`, :mod:`.thresholds`, :mod:`.train`,
:mod:`.determinism`; :mod:`.run` runs them under one MLflow parent run, :mod:`.report` writes
report.md / report.html, :mod:`.faults` is the ``inject_fault`` test switch, :mod:`.pytest_plugin`
the kernel check's pytest plugin. Sizes per device class: ``conf/validate.yaml`` (``validate.sizes``).

Time on one H200 (``hardware=h200``, estimates: the GPU sizes were set without a GPU at hand; the run
prints each check's time, and the report has them): env 1 s; kernels about 150 s (pytest's start, ~100
Triton compilations for the six group sizes, 68 tests, the 128k case about 10 s); decode about 30 s (2
batches x 2 contexts, 6 rows each from graphs of 20 steps, the GraphDecoder's compilation); prefill about
40 s (8k-64k, 9 calls of NSA, cuDNN and FA-2 dense, forward and forward+backward); thresholds about 45 s
(7 lengths x 3 window backends, FlexAttention's compilation); train about 30 s (2 x 100 steps of the
smoke model, compilation at its shapes); determinism about 10 s; with the process start about 5 minutes.
"""
