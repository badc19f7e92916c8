"""Corpora, tokenizers and the cached token files that train.py reads.

An ATEN_CPU_CAPABILITY this CPU cannot run is refused first, before any of it loads
torch, which would die of it at its first kernel (common/cpu.py)."""
from common.cpu import refuse_on_import as _refuse_on_import

_refuse_on_import()
