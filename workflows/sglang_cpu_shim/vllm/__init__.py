"""Not vLLM: the one op SGLang's CPU fallback imports (see ../README.md)."""

__version__ = "0.0.0+eagle3-sglang-cpu-shim"
