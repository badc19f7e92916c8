"""The run machinery. Importing any part of it registers the BERT-family encoders
(engine/interop_bert.py) and gpt-oss (engine/interop_gpt_oss.py) among
engine/interop.py's architectures, which they build on."""
import engine.interop_bert  # noqa: F401
import engine.interop_gpt_oss  # noqa: F401
