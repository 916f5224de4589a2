"""Model-quality evaluation of fmkv and baseline KV-cache quantizers (perplexity, KLD, needle).

``python -m fmkv.eval ppl ...`` / ``python -m fmkv.eval needle ...``; see docs/EVAL.md.
"""
from .quantizers import KVQuantizer, parse_config, DEFAULT_CONFIGS  # noqa: F401
