"""Corpora, tokenizers and the cached token files that train.py reads.

A tool started with `python -m data.NAME` first refuses an ATEN_CPU_CAPABILITY this CPU
cannot run, before torch loads (common/cpu.py); imported, the package checks nothing."""
from common.cpu import check_tool_start as _check_tool_start

_check_tool_start()
