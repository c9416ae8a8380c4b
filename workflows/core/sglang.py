"""SGLang: the target engine (`backend=sglang`) and the one place for its CPU settings.

* `CPU_SETTINGS` are what SGLang 0.5.23 needs to run on a CPU (torch_native attention,
  pytorch sampling, no CUDA graphs, no overlap schedule, no radix cache, a small static
  memory fraction); `engine_kwargs` gives them to an in-process `sgl.Engine`,
  `server_cpu_args` to `sglang.launch_server`. On CPU, SGLang's RoPE fallback imports
  `vllm._custom_ops`; `workflows/sglang_cpu_shim` provides that one function and goes on
  the path of CPU SGLang processes only (`with_shim`).
* `SGLangEngine` implements the engine interface of workflows.core.engines. Generation runs
  an in-process Engine, created on first use and kept for the engine's life.
* Hidden states come from a capture worker (`workflows.core.sglang_worker`): a child process
  (SGLang sets process-wide state, and its scheduler can SIGKILL its caller on an error) that
  the engine starts on its first `states()` call and keeps for its life, i.e. one SGLang
  engine per Ray actor for the whole stage, answering requests over a pipe. The request list
  applies each family's id rule (`eagle3.layer_ids.sglang_capture_plan`). How the final
  hidden state comes back (`capture.final_state`):
  - `runner` (what `auto` picks): the worker drives SGLang's ModelRunner itself
    (`workflows.core.sglang_runner`), which returns the aux and the final states of one
    forward as tensors; the arrays come back as one file per call, bf16 kept as bf16.
  - `tail`: the Engine's aux mode returns the aux states *instead of* the final one, so the
    worker also asks for id N-2, the last layer's input, and this process computes the last
    layer and the final norm (`workflows.core.last_layer`). The states travel as lists
    through SGLang's processes (0.70-0.75 of a bare prefill on CPU), and the tail cannot
    run a quantized layer: the public-API alternative to `runner`, not the default.
  Radix cache is off (with it on, only the uncached suffix comes back). Id N-1 (the last
  layer's output) is never returned by SGLang: it needs the tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from eagle3.layer_ids import sglang_capture_plan, sglang_captured_ids
from eagle3.schema import ConfigError
from workflows.core.engine_spec import EngineSpec

ROOT = Path(__file__).resolve().parents[2]
SHIM_DIR = ROOT / "workflows" / "sglang_cpu_shim"
CPU_SETTINGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "disable_overlap_schedule": True,
    "disable_radix_cache": True,
    "mem_fraction_static": 0.05,
}


def engine_kwargs(spec: EngineSpec, **extra) -> dict:
    """Keyword arguments of `sgl.Engine` for this spec (CPU settings when spec.device is cpu)."""
    kw = {
        "model_path": spec.target_path,
        "tp_size": spec.tp_size,
        "dtype": spec.dtype,
        "log_level": "warning",
        "skip_server_warmup": True,
        "random_seed": spec.seed,
        "trust_remote_code": spec.trust_remote_code,
        # The pipeline feeds text only. A multimodal wrapper (kimi_k25) would otherwise load
        # its image processor, which a text-only checkpoint lacks; for a text model the
        # setting does nothing.
        "enable_multimodal": False,
        **extra,
    }
    if spec.max_total_tokens is not None:
        kw["max_total_tokens"] = spec.max_total_tokens
    if spec.device == "cpu":
        kw.update(CPU_SETTINGS)
    return kw


# EAGLE-3 speculative decoding on a CPU: SGLang's CPU engine, with the stand-ins of
# workflows/sglang_cpu_shim for what its EAGLE path lacks there (the Intel build's kernels,
# torch_native draft and verify attention; they load through the shim's sitecustomize),
# torch.compile off (tens of seconds of compiling, nothing gained on a small model), and
# room in the memory plan for the draft's KV pool (0.05 is not enough once it is loaded).
SPECULATIVE_CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1"}
SPECULATIVE_CPU_SETTINGS = {**CPU_SETTINGS, "mem_fraction_static": 0.2}


def cpu_env(env: dict, speculative: bool = False) -> dict:
    """`env` for a CPU SGLang process: the shim on its path, and with a draft the settings above."""
    return {**with_shim(env), **(SPECULATIVE_CPU_ENV if speculative else {})}


def server_cpu_args(dtype: str = "float32", max_total_tokens: int = 4096, speculative: bool = False) -> list[str]:
    """`sglang.launch_server` flags for the same CPU settings."""
    args = []
    settings = SPECULATIVE_CPU_SETTINGS if speculative else CPU_SETTINGS
    for key, value in {**settings, "max_total_tokens": max_total_tokens, "dtype": dtype}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def speculative_args(num_steps: int, topk: int, num_draft_tokens: int) -> list[str]:
    """SGLang's drafting flags for these settings (the report states them; serve passes them)."""
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        str(num_steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(num_draft_tokens),
    ]


FINAL_METHODS = {
    "runner": "from the same forward (SGLang's model runner in the capture worker returns the aux "
    "and the final states as tensors)",
    "tail": "from the same forward (the last layer's input, then that layer and the final norm in the actor)",
}


def read_text_config(spec: EngineSpec) -> dict:
    """The target's language-model config (a multimodal target's text_config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.target_path, trust_remote_code=spec.trust_remote_code)
    return config.get_text_config().to_dict()


def with_shim(env: dict) -> dict:
    """`env` with the CPU shim (and the project) first on PYTHONPATH."""
    paths = [str(SHIM_DIR), str(ROOT), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


class SGLangEngine:
    backend = "sglang"
    final_is_normed = True  # SGLang's returned hidden state is after the final norm

    def __init__(self, spec: EngineSpec):
        from transformers import AutoTokenizer

        self.spec, self.timeout_s = spec, spec.timeout_s
        self.tokenizer = AutoTokenizer.from_pretrained(spec.target_path, trust_remote_code=spec.trust_remote_code)
        self._engine = None  # generation: an in-process engine
        self._proc = None  # hidden states: the capture worker (a child process with its own engine)
        self.engine_starts, self.final_method = 0, None
        # After the first states(): the layers (by input) the capture worker's model reports
        # capturing, and the ids they make of the stored ones; None where not reported (tail).
        self.layers_to_capture: list[int] | None = None
        self.captured_layer_ids: list[int] | None = None

    @staticmethod
    def version() -> str:
        from importlib.metadata import version

        return f"sglang {version('sglang')}"

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> list[tuple[list[int], str]]:
        if self._engine is None:
            if self.spec.device == "cpu":  # this process and the scheduler processes it forks
                sys.path.insert(0, str(SHIM_DIR))
                os.environ.update(with_shim(dict(os.environ)))
            import sglang as sgl

            self._engine = sgl.Engine(**engine_kwargs(self.spec))
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        results = []
        for out in self._engine.generate(input_ids=prompts, sampling_params=params):
            finish = (out["meta_info"].get("finish_reason") or {}).get("type")
            ids = [t for t in out["output_ids"] if t not in self.tokenizer.all_special_ids]
            results.append((ids, "length" if finish == "length" else "eos"))
        return results

    # ------------------------------------------------------------------ hidden states
    def _start_capture_worker(self) -> None:
        """The engine's child process, started once: it holds one SGLang engine for the
        life of this engine (the actor's stage) and answers capture requests over a pipe."""
        # torch only once a capture starts: serving and the served check import this module's
        # settings alone.
        from workflows.core.last_layer import FinalLayerTail, TailUnavailable
        from workflows.core.target_builders import torch_dtype

        text = read_text_config(self.spec)
        num_layers, model_type = int(text["num_hidden_layers"]), str(text.get("model_type", ""))
        method = "runner" if self.spec.final_state == "auto" else self.spec.final_state
        self._tail = None
        if method == "tail" or (method == "runner" and num_layers - 1 in self.spec.capture_ids):
            try:
                self._tail = FinalLayerTail(
                    self.spec.target_path,
                    torch_dtype(self.spec.dtype),
                    "cuda" if self.spec.device == "cuda" else "cpu",
                    self.spec.trust_remote_code,
                )
            except TailUnavailable as exc:
                what = (
                    "capture.final_state=tail"
                    if method == "tail"
                    else (
                        f"capture id {num_layers - 1} (the last layer's output, which SGLang never returns) needs "
                        "the last layer's tail"
                    )
                )
                raise ConfigError(f"{what}: {exc}") from None
        request, self._slots = sglang_capture_plan(
            self.spec.capture_ids, num_layers, model_type, last_input=self._tail is not None
        )
        self._num_layers, self.final_method = num_layers, method
        print(f"capture: SGLang engine for the stage; final state {FINAL_METHODS[method]}", flush=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="sglang_capture_")
        spec_file = Path(self._tmp.name) / "spec.json"
        spec_file.write_text(json.dumps({"spec": vars(self.spec), "method": method, "request": request}))
        self._stderr = open(Path(self._tmp.name) / "stderr.log", "w+", errors="replace")
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        env = with_shim(dict(os.environ)) if self.spec.device == "cpu" else dict(os.environ)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "workflows.core.sglang_worker", str(spec_file), str(req_r), str(resp_w)],
                env=env,
                cwd=ROOT,
                pass_fds=(req_r, resp_w),
                stdout=self._stderr,
                stderr=self._stderr,
            )
        except BaseException:
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
            self._stderr.close()
            self._tmp.cleanup()
            raise
        os.close(req_r)
        os.close(resp_w)
        self._req_w, self._resp_r, self._buf, self._calls = req_w, resp_r, b"", 0
        self.engine_starts += 1
        reported = self._call({}, "start").get("layers_to_capture")
        self.layers_to_capture = reported
        if reported is not None:  # runner: refuse at once a model that captures other layers than planned
            self.captured_layer_ids = sglang_captured_ids(self.spec.capture_ids, num_layers, self._slots, reported)
            if self.captured_layer_ids != list(self.spec.capture_ids):
                self.close(kill=True)
                raise RuntimeError(
                    f"SGLang's {model_type} model captures the inputs of layers {sorted(reported)} for the request "
                    f"{request}: the stored ids {list(self.spec.capture_ids)} would hold ids "
                    f"{self.captured_layer_ids} (its layer-id rule differs from eagle3.layer_ids')"
                )

    def _call(self, message: dict, what: str) -> dict:
        """Send one request (numbered) and wait for its reply. A worker that died, went
        silent or answered with an error raises RuntimeError with its log's tail; a reply to
        an earlier, abandoned request is skipped, never taken for this one's."""
        import select

        self._calls += 1
        n = self._calls
        try:
            if message:
                os.write(self._req_w, (json.dumps({**message, "n": n}) + "\n").encode())
            poller = select.poll()
            poller.register(self._resp_r, select.POLLIN)
            while True:
                while b"\n" not in self._buf:
                    if not poller.poll(self.timeout_s * 1000):
                        raise TimeoutError(f"did not answer within {self.timeout_s:g} s")
                    chunk = os.read(self._resp_r, 1 << 16)
                    if not chunk:
                        raise EOFError("exited")
                    self._buf += chunk
                line, self._buf = self._buf.split(b"\n", 1)
                reply = json.loads(line)
                if reply.get("n", n) == n or not message:
                    break
        except (OSError, TimeoutError, EOFError) as exc:  # BrokenPipeError: it died before reading
            rc = self._proc.poll()
            self._stderr.seek(0)
            tail = self._stderr.read()[-3000:]
            self.close(kill=True)  # dead, or hung past its timeout: no grace period
            raise RuntimeError(f"SGLang capture worker failed during {what} ({exc}; rc {rc}): {tail}") from None
        if "error" in reply:
            if self.spec.tp_size > 1:  # its TP ranks may be out of step now: the next call starts afresh
                self.close(kill=True)
            raise RuntimeError(f"SGLang capture failed: {reply['error']}")
        return reply

    def _request(self, seqs, what: str, **fields) -> Path:
        """Start the worker if it is not running, hand it `seqs` in this request's own files
        (an abandoned request never shares them) and wait for its answer; returns the path the
        states were written to, if the request asked for states."""
        if self._proc is None:
            self._start_capture_worker()
        k = self._calls + 1
        seqs_file, out = Path(self._tmp.name) / f"seqs-{k}.json", Path(self._tmp.name) / f"out-{k}.npz"
        seqs_file.write_text(json.dumps([list(map(int, s)) for s in seqs]))
        try:
            self._call({"seqs": str(seqs_file), "out": str(out), **fields}, what)
        finally:
            seqs_file.unlink(missing_ok=True)
        return out

    def states(self, seqs):
        import numpy as np
        import torch

        from storage.zarr_io import from_bf16_bits

        out = self._request(seqs, "capture")
        with np.load(out) as data:
            if self.final_method == "runner":  # one array each for the whole call; bf16 as its bits
                bf16 = str(data["dtype"]) == "bfloat16"
                aux, final = (
                    from_bf16_bits(data[key]) if bf16 else torch.from_numpy(data[key]) for key in ("aux", "final")
                )
                lens = [len(s) for s in seqs]
                arrays = list(zip(aux.split(lens), final.split(lens)))
            else:
                arrays = [(torch.from_numpy(data[f"aux_{i}"]), None) for i in range(len(seqs))]
        out.unlink()
        H = arrays[0][0].shape[1] // len(self._slots)
        blocks = [aux.split(H, dim=1) for aux, _ in arrays]
        last_outs, finals = [None] * len(arrays), [final for _, final in arrays]
        if self._tail is not None:
            last_outs, tail_finals = self._tail.batch(
                [b[self._slots[self._num_layers - 2]] for b in blocks], self.spec.micro_batch_tokens
            )
            if self.final_method == "tail":
                finals = tail_finals
        results = []
        for b, last_out, final in zip(blocks, last_outs, finals):
            picked = [last_out if i == self._num_layers - 1 else b[self._slots[i]] for i in self.spec.capture_ids]
            results.append((torch.cat(picked, dim=1), final))
        return results

    def bare_forward(self, seqs) -> None:
        """The same sequences through the capture worker's engine as a plain prefill, no state
        returned (the capture benchmark's baseline)."""
        self._request(seqs, "bare forward", bare=True)

    def close(self, kill: bool = False) -> None:
        """Shut the engines down; safe to call again, and after a failed start. kill: SIGKILL
        the capture worker at once (its TP ranks and SGLang's processes exit with it)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        os.close(self._req_w)  # EOF: the worker shuts its engine down and exits
        try:
            if kill:
                proc.kill()
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            os.close(self._resp_r)
            self._stderr.close()
            self._tmp.cleanup()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def exit_with_parent() -> None:
    """Exit this process as soon as the one that started it is gone. The actor may die
    mid-request (OOM, preemption, SIGKILL): then no EOF comes until the request ends, and the
    engine would hold the actor's GPUs for the actor Ray restarts."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
