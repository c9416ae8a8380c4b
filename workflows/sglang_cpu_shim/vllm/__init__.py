"""Not vllm: a stand-in exposing the single op SGLang's CPU fallback imports (see ../README.md)."""
__version__ = "0.0.0+eagle3-cpu-shim"
