"""Programmatic dependent launch (PDL, sm_90+): the entry every decode kernel makes before reading its
inputs. Its own module so that the decode attention kernels and the step prologue's kernels share it
without importing each other."""

# No ``from __future__ import annotations``: triton 2.3/3.0 reads the kernel annotations as objects.
import torch
import triton
import triton.language as tl

from .utils import capability

try:  # grid dependency control: triton >= 3.4
    from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # the kernels reach these only with PDL=True, which pdl_supported() refuses here
    HAS_GDC = False
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the previous kernel in the stream has finished
    and its writes are visible, then let the next one start launching (its programs then wait here
    in turn, so no launch latency lies between the step's kernels). Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_supported(device=None) -> bool:
    """Whether programmatic dependent launch is available.

    Arguments:
        device: the CUDA device asked about (an index or ``torch.device``); None: the current one.

    Returns:
        True where triton has grid dependency control (3.4+) and the device is a GPU of sm_90 or later.
    """
    return HAS_GDC and torch.cuda.is_available() and capability(device)[0] >= 9
