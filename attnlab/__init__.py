"""attnlab: the tools that look inside a model and study attention (heatmaps, the lens,
heads, the article's figures, the exercises, the local page), each run as
`python -m attnlab.NAME`. They build on engine/ (training, checkpoints, devices), which
builds on model/ and data/.

A tool started with `python -m attnlab.NAME` first refuses an ATEN_CPU_CAPABILITY this
CPU cannot run, before torch loads and would die of it (common/cpu.py); imported from other
code, the package checks nothing."""
from common.cpu import check_tool_start as _check_tool_start

_check_tool_start()
