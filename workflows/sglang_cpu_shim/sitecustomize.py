"""Runs at the start of every Python process that has this folder on its PYTHONPATH (CPU
SGLang processes only, see README.md). It arranges for the MLA attention patch to be
applied to SGLang's DeepSeek attention dispatch as it loads (every CPU SGLang process runs
torch_native attention, serving or not), and with SGLANG_USE_CPU_ENGINE=1 for the EAGLE-3
serving patches too; in a process that never imports SGLang, nothing is patched."""

import os

import sglang_cpu_mla

sglang_cpu_mla.install()

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import sglang_cpu_eagle

    sglang_cpu_eagle.install()
