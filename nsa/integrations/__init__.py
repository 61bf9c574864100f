"""NSA in other libraries' models: :mod:`nsa.integrations.hf` (Hugging Face transformers; the ``[hf]`` extra)."""
