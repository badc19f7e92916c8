"""The ground floor: helpers every other floor may use, importing nothing of the
project. errors (the one error type and the `error:` line), files (hashes and atomic
writes), fields (a config field with its help text and choices), threads (how torch's CPU
threads wait, set before torch loads, and how many it uses while other work holds the CPU),
cpu (whether the CPU runs the kernels ATEN_CPU_CAPABILITY asks torch for)."""
