"""Device detection and hardware profiles (``conf/hardware/*.yaml``).

A profile says how to recognise its device (``match``: device type, name substrings, compute
capability), its ceilings for roofline shares (``peak_hbm_gbps``, ``peak_bf16_tflops``) and a
per-branch backend policy (``policy``: ``preferred`` for ``backend=auto``, refined per entry point by
``by_entry`` and per length by ``by_seq``; ``avoid`` replacements that apply unless ``policy.force``;
``config.prepare`` applies it). ``hardware=auto`` picks the first profile that matches.
"""
from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Order in which hardware=auto tries profiles: specific GPUs first, cpu last.
AUTO_ORDER = ("h200", "h100", "a100", "rtx4090", "cpu")


class HardwareMismatch(ValueError):
    pass


@dataclass(frozen=True)
class Device:
    type: str                  # "cuda" or "cpu"
    name: str
    capability: tuple | None   # (major, minor) on CUDA
    driver: str                # NVIDIA driver version, "" where unknown / on CPU
    count: int

    def describe(self) -> str:
        cc = f" (SM {self.capability[0]}.{self.capability[1]})" if self.capability else ""
        return f"{self.name}{cc}"


_DETECTED: Device | None = None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def detect() -> Device:
    """The device this process would run on (GPU 0 if CUDA is available). Cached."""
    global _DETECTED
    if _DETECTED is None:
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            _DETECTED = Device("cuda", p.name, (p.major, p.minor), _driver(), torch.cuda.device_count())
        else:
            _DETECTED = Device("cpu", _cpu_name(), None, "", 1)
    return _DETECTED


_PROFILES: dict[str, DictConfig] = {}


def load_profile(name: str) -> DictConfig:
    if name not in _PROFILES:
        path = CONF_DIR / "hardware" / f"{name}.yaml"
        if not path.is_file():
            raise HardwareMismatch(f"hardware={name}: no profile conf/hardware/{name}.yaml")
        _PROFILES[name] = OmegaConf.load(path)
    return OmegaConf.create(OmegaConf.to_container(_PROFILES[name]))


def matches(profile: DictConfig, dev: Device) -> bool:
    m = profile.match
    if m.device_type == "cpu":
        return True  # CPU profiles run anywhere: tensors stay on the CPU
    if dev.type != m.device_type:
        return False
    if m.capability is not None and tuple(m.capability) != dev.capability:
        return False
    subs = list(m.name_contains or [])
    return not subs or any(s.lower() in dev.name.lower() for s in subs)


def resolve_profile(hw: DictConfig, dev: Device | None = None, check: bool = True) -> tuple[DictConfig, str]:
    """The profile to use and how it was chosen. Raises HardwareMismatch (one line) if a strict
    profile does not match the detected device, or auto finds none. ``check=False`` (the job runs on
    another host): a named profile is taken as it is; auto is resolved here, for what this host can tell."""
    dev = dev or detect()
    if not check and hw.name != "auto":
        return hw, f"{hw.name}: matched to the device where the job runs"
    if hw.name == "auto":
        for name in AUTO_ORDER:
            prof = load_profile(name)
            if (prof.match.device_type != "cpu" or dev.type == "cpu") and matches(prof, dev):
                return prof, f"auto: detected {dev.describe()}"
        raise HardwareMismatch(
            f"hardware=auto: no profile in conf/hardware matches the detected device {dev.describe()}; "
            f"add one, or pick one with hardware=<profile> hardware.strict=false")
    if not matches(hw, dev):
        if hw.get("strict", True):
            # on a CPU a GPU profile times nothing (config.check_timed_device): no hint towards strict=false
            hint = ("use hardware=cpu or hardware=auto on this machine" if dev.type == "cpu" != hw.match.device_type
                    else "use hardware=auto, or hardware.strict=false to run with this profile anyway")
            raise HardwareMismatch(f"hardware={hw.name} does not match the detected device {dev.describe()}; {hint}")
        return hw, f"{hw.name}: forced (hardware.strict=false) on {dev.describe()}"
    return hw, f"{hw.name}: matches {dev.describe()}"


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for this job's tensors: on a GPU what CUDA reports free on it (``mem_get_info``); on a
    CPU the host's available memory (``MemAvailable`` of /proc/meminfo: free pages and the caches the kernel
    can drop), else free pages (``os.sysconf``) where there is no /proc."""
    import os

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
