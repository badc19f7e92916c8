"""The run machinery. Importing any part of it registers the BERT-family encoders
(engine/interop_bert.py), gpt-oss (engine/interop_gpt_oss.py), Gemma 3
(engine/interop_gemma3.py), DeepSeek-V3 and V3.2 (engine/interop_deepseek.py), Qwen3-Next
(engine/interop_qwen3_next.py) and Kimi Linear (engine/interop_kimi_linear.py) among
engine/interop.py's architectures, which they build on."""
import engine.interop_bert  # noqa: F401
import engine.interop_deepseek  # noqa: F401
import engine.interop_gemma3  # noqa: F401
import engine.interop_gpt_oss  # noqa: F401
import engine.interop_kimi_linear  # noqa: F401
import engine.interop_qwen3_next  # noqa: F401
