"""NOT vLLM. A two-function stand-in so SGLang's RoPE fallback imports on a CPU machine.

SGLang 0.5.23 without its GPU kernels imports `vllm._custom_ops.rotary_embedding` when it
builds a rotary embedding. This folder goes on PYTHONPATH only for CPU SGLang processes
(tests, the CPU server in workflows.serve); GPU installs never see it.
"""
