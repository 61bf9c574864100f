"""Native Sparse Attention (Yuan et al., arXiv 2502.11089): reference, module, backend dispatch."""
from . import context_parallel, dispatch, functional, reference
from .config import NSAConfig
from .module import NSAAttention, NSACache

__all__ = ["NSAConfig", "NSAAttention", "NSACache", "functional", "reference", "dispatch", "context_parallel"]
__version__ = "0.1.0"
