"""Runs at the start of every Python process that has this folder on its PYTHONPATH (CPU
SGLang processes only, see README.md). With SGLANG_USE_CPU_ENGINE=1 it arranges for the
EAGLE-3 serving patches to be applied to SGLang's modules as they load; otherwise, and in
any process that never imports SGLang, it does nothing."""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import sglang_cpu_eagle

    sglang_cpu_eagle.install()
