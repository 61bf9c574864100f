"""The torch/triton pairing: which ones are supported, which are known to break, and the run-time check.

``check_toolchain()`` returns the pairing's id (``"torch2.11+triton3.6"``, or ``"torch2.13+notriton"``
where triton is absent, as with the CPU wheel) and raises :class:`ToolchainError`, with one line that
names the pair and the supported pairs, for a pairing known to break. Pairings that are neither
supported nor known to break pass with their id.

Where the tables come from:

* ``TRITON_PINNED_BY_TORCH``: the ``Requires-Dist: triton==...`` line of each torch release's Linux
  x86-64 wheel on PyPI (read from the wheels' METADATA, 2026-11). torch's CUDA wheels require exactly
  that triton; the CPU wheels require none.
* ``KNOWN_BAD``: pairings that fail on import or on first compile, each with its reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "KNOWN_BAD",
    "SUPPORTED_PAIRS",
    "TRITON_PINNED_BY_TORCH",
    "ToolchainError",
    "check_toolchain",
    "installed_versions",
    "parse_version",
    "toolchain_id",
]

Version = tuple[int, int]

# (torch major.minor, triton major.minor): the pairings the nox sessions test (noxfile.PAIRINGS).
# triton None: torch without triton (CPU wheel), where the reference backends alone run.
SUPPORTED_PAIRS: tuple[tuple[str, str], ...] = (
    ("2.3", "2.3"),   # oldest supported
    ("2.4", "3.0"),
    ("2.11", "3.6"),  # the H200 box: torch 2.11.0+cu130, triton 3.6.0
    ("2.13", "3.7"),  # the newest, and the Quickstart's: torch 2.13.0's CUDA wheels pin triton 3.7.1 (the CPU wheel pins none)
)

# torch major.minor -> the triton major.minor its Linux CUDA wheels pin (==) on PyPI.
TRITON_PINNED_BY_TORCH: dict[str, str] = {
    "2.0": "2.0",   # torch 2.0.1 -> triton==2.0.0
    "2.1": "2.1",   # 2.1.2 -> 2.1.0
    "2.2": "2.2",   # 2.2.2 -> 2.2.0
    "2.3": "2.3",   # 2.3.0 -> 2.3.0, 2.3.1 -> 2.3.1
    "2.4": "3.0",   # 2.4.0, 2.4.1 -> 3.0.0
    "2.5": "3.1",   # 2.5.0, 2.5.1 -> 3.1.0
    "2.6": "3.2",   # 2.6.0 -> 3.2.0
    "2.7": "3.3",   # 2.7.0 -> 3.3.0, 2.7.1 -> 3.3.1
    "2.8": "3.4",   # 2.8.0 -> 3.4.0
    "2.9": "3.5",   # 2.9.0 -> 3.5.0, 2.9.1 -> 3.5.1
    "2.10": "3.6",  # 2.10.0 -> 3.6.0
    "2.11": "3.6",  # 2.11.0 -> 3.6.0
    "2.12": "3.7",  # 2.12.0 -> 3.7.0, 2.12.1 -> 3.7.1
    "2.13": "3.7",  # 2.13.0 -> 3.7.1
    "2.14": "3.8",  # 2.14.0 -> triton~=3.8.0
    "2.15": "3.9",  # 2.15.0 -> triton~=3.9.0
}


@dataclass(frozen=True)
class BadRange:
    """torch in [torch_min, torch_max] with triton in [triton_min, triton_max] is known to break."""

    torch_min: Version
    torch_max: Version
    triton_min: Version
    triton_max: Version
    reason: str

    def matches(self, torch_v: Version, triton_v: Version) -> bool:
        """Arguments:
            torch_v, triton_v: (major, minor) versions.

        Returns:
            Whether the pair lies in this known-bad range.
        """
        return (self.torch_min <= torch_v <= self.torch_max) and (self.triton_min <= triton_v <= self.triton_max)


_ANY_MAX = (99, 99)
KNOWN_BAD: tuple[BadRange, ...] = (
    BadRange(
        (2, 4), _ANY_MAX, (0, 0), (2, 99),
        "torch >= 2.4 Inductor imports triton.compiler.compiler.triton_key, which triton 2.x lacks: "
        "ImportError: cannot import name 'triton_key'; pytorch/pytorch#127271",
    ),
    BadRange(
        (0, 0), (2, 3), (3, 0), _ANY_MAX,
        "torch <= 2.3 imports triton.common.backend (torch/utils/_triton.py), which triton 3.0 removed: "
        "ModuleNotFoundError: No module named 'triton.common'; triton-lang/triton#4250",
    ),
    BadRange(
        (0, 0), (2, 5), (3, 2), _ANY_MAX,
        "torch.compile on torch < 2.6 fails with triton >= 3.2 (AttrsDescriptor changed); triton-lang/triton#5722",
    ),
    BadRange(
        (0, 0), (2, 6), (3, 3), _ANY_MAX,
        "triton 3.3 removed AttrsDescriptor, which torch <= 2.6 Inductor imports: "
        "ImportError: cannot import name 'AttrsDescriptor'; Comfy-Org/ComfyUI#7106",
    ),
    BadRange(
        (2, 7), (2, 7), (3, 4), _ANY_MAX,
        "triton 3.4 moved CompiledKernel.launch_enter_hook to triton.knobs, which torch 2.7 Inductor "
        "still uses; pytorch/pytorch#152531",
    ),
)


class ToolchainError(RuntimeError):
    """The installed torch/triton pairing is known to break."""


_VERSION_RE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?")


def parse_version(version: str) -> Version:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``"3.0.0.post1"``, ``"2.4.0a0+git1234"`` and ``"3.6"`` parse too."""
    m = _VERSION_RE.match(str(version))
    if not m:
        raise ValueError(f"cannot parse version {version!r}")
    return int(m.group(1)), int(m.group(2) or 0)


def _mm(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def toolchain_id(torch_version: str, triton_version: str | None) -> str:
    """``("2.11.0+cu130", "3.6.0")`` -> ``"torch2.11+triton3.6"``; triton None -> ``"torch2.13+notriton"``."""
    triton_part = f"triton{_mm(parse_version(triton_version))}" if triton_version else "notriton"
    return f"torch{_mm(parse_version(torch_version))}+{triton_part}"


def supported_ids() -> tuple[str, ...]:
    """Returns: the toolchain ids (``torch2.13+triton3.7``, ...) of ``SUPPORTED_PAIRS``."""
    return tuple(f"torch{t}+triton{tr}" for t, tr in SUPPORTED_PAIRS)


def installed_versions() -> tuple[str, str | None]:
    """(torch.__version__, triton.__version__ or None when triton is not installed)."""
    import torch

    try:
        import triton
    except ImportError:
        return torch.__version__, None
    return torch.__version__, getattr(triton, "__version__", None)


def check_toolchain(torch_version: str | None = None, triton_version: str | None = None) -> str:
    """The id of the torch/triton pairing; :class:`ToolchainError` if it is known to break.

    With no arguments, checks the installed torch and triton (triton absent is fine). Pass both
    versions to check a pairing without importing either.
    """
    if torch_version is None:
        torch_version, installed_triton = installed_versions()
        if triton_version is None:
            triton_version = installed_triton
    ident = toolchain_id(torch_version, triton_version)
    if triton_version is None:
        return ident
    torch_v, triton_v = parse_version(torch_version), parse_version(triton_version)
    for bad in KNOWN_BAD:
        if bad.matches(torch_v, triton_v):
            pinned = TRITON_PINNED_BY_TORCH.get(_mm(torch_v))
            wants = f"; torch {_mm(torch_v)} wheels pin triton {pinned}" if pinned else ""
            raise ToolchainError(
                f"torch {torch_version} with triton {triton_version} is a known-bad pairing "
                f"({bad.reason}{wants}); supported: {', '.join(supported_ids())}"
            )
    return ident
