"""What the benchmarks time and count, one module per concern:

* :mod:`.inputs`: the attention inputs of one layer call (``CoreInputs``) from a prefill or a filled cache;
* :mod:`.branches`: the NSA attention core, all branches or one forced alone, and ``ForcedBranch``;
* :mod:`.dense`: the dense SDPA baseline (and its ragged decode step);
* :mod:`.timing`: timers, CUDA-graph capture and replay, quantiles, a profiler table;
* :mod:`.tokens`: key/value tokens read per branch, from the indices and from the paper's formula.
"""
