"""attnlab: the tools that look inside a model and study attention (heatmaps, the lens,
heads, the article's figures, the exercises, the local page), each run as
`python -m attnlab.NAME`. They build on engine/ (training, checkpoints, devices), which
builds on model/ and data/.

An ATEN_CPU_CAPABILITY this CPU cannot run is refused here, before any tool loads torch,
which would die of it at its first kernel (common/cpu.py): one line for `python -m`, an
ImportError naming it in a notebook."""
from common.cpu import refuse_on_import as _refuse_on_import

_refuse_on_import()
