"""A small decoder language model trained with NSA, dense or sliding-window attention.

``model`` (the model and its parameter counts), ``data`` (the retrieval task and the text corpus),
``probes`` (gate means, selection quality), ``checkpoint`` (atomic save, peek), ``config``
(``TrainConfig``, ``RunConfig``), ``loop`` (``train``), ``hf`` (``lm=hf``: a transformers model in the
loop). Configured by ``conf/train.yaml`` and its groups ``lm``, ``attention``, ``data``, ``train``.
"""
