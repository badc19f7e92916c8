"""The run machinery. Importing any part of it registers the BERT-family encoders
(engine/interop_bert.py) among engine/interop.py's architectures, which they build on.

An ATEN_CPU_CAPABILITY this CPU cannot run is refused first, before any of it loads
torch, which would die of it at its first kernel (common/cpu.py)."""
from common.cpu import refuse_on_import as _refuse_on_import

_refuse_on_import()
import engine.interop_bert  # noqa: E402,F401
