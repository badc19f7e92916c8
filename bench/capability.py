"""Imported first by every bench script, before torch: an ATEN_CPU_CAPABILITY this CPU
cannot run is refused in one line (common/cpu.py), where torch would die of SIGILL at its
first kernel with nothing said, and one torch would ignore is refused where it would
measure another kind than the one asked for. cpu_model() names the CPU for a
script's machine line."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.cpu import refuse_unrunnable_capability  # noqa: E402

refuse_unrunnable_capability()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "an unnamed CPU")
    except OSError:
        return "an unnamed CPU"
