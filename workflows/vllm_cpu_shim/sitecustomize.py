"""Runs at the start of every Python process that has this folder on its PYTHONPATH (vLLM
processes on a CPU only: workflows.core.serving puts it there for them). With
EAGLE3_VLLM_CPU_STANDINS=1 it arranges for the stand-ins of `vllm_cpu_standins` to be
applied to vLLM's modules as they load; otherwise it does nothing."""

import os

if os.environ.get("EAGLE3_VLLM_CPU_STANDINS") == "1":
    import vllm_cpu_standins

    vllm_cpu_standins.install()
