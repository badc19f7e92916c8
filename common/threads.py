"""How torch's CPU threads wait for each other, set before torch loads (OpenMP reads it
once, when the library is loaded).

By default OpenMP threads spin at the end of each parallel piece of work, waiting for
the others. On a machine whose other cores are busy (a laptop with a browser open, a
shared server) the thread they wait for may not be running at all, and the spinning
takes the core it needs: on a 2-core CPU under load a training step took about ten times
as long on torch's default 2 threads as on 1. Waiting passively (asleep until woken)
makes 2 threads cost about what 1 does under load; docs/benchmarks.md has the figures,
`python bench/cpu_kinds.py --busy` measures them. OMP_WAIT_POLICY set by the user wins.
"""
from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"


def wait_passively(env=os.environ) -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment already says otherwise."""
    if not env.get("OMP_WAIT_POLICY", "").strip():
        env["OMP_WAIT_POLICY"] = WAIT_POLICY
