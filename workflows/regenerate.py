"""Target engines and the Ray Data callable that regenerates conversations.

Every assistant turn is regenerated in order: turn t's answer is generated from the
system prompt, the user turns up to t and the *regenerated* answers before it, so the
history the draft trains on is what the target would really have said. Batches advance
turn by turn, all conversations of the batch together.

Engines (one per Ray actor):
* `hf`: batched, left-padded `transformers` generate (the CPU default).
* `sglang`: an SGLang `Engine` in the actor; on CPU it needs the tiny vllm shim in
  workflows/sglang_cpu_shim (put on the path here) and the CPU kwargs below.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle3.chat_template import (TemplateError, apply_length_policy, check_template, generation_prompt_ids,
                                  tokenize_conversation)

SHIM_DIR = Path(__file__).resolve().parent / "sglang_cpu_shim"


@dataclass
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    reasoning: bool = False
    keep_reasoning: bool = True
    max_length: int = 512
    overlong: str = "truncate"
    backend: str = "hf"
    dtype: str = "float32"
    threads: int = 0
    seed: int = 0
    sglang_max_total_tokens: int = 4096
    trust_remote_code: bool = False

    @property
    def template_kwargs(self) -> dict:
        # Templates that know it (Qwen3, ...) switch thinking on/off; others ignore the variable.
        return {"enable_thinking": self.reasoning}


class HFEngine:
    def __init__(self, target_path: str, s: Settings):
        import torch

        from workflows.target import load_target

        if s.threads:
            torch.set_num_threads(s.threads)
        self.model, self.tokenizer = load_target(target_path, dtype=s.dtype, trust_remote_code=s.trust_remote_code)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos = {e for e in [*eos, self.tokenizer.eos_token_id] if e is not None}
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)

    def generate(self, prompts: list[list[int]], s: Settings) -> list[tuple[list[int], str]]:
        """(answer ids without the stop token, finish) per prompt: finish is 'eos' or 'length'."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sample = s.temperature > 0
        extra = {"temperature": s.temperature, "top_p": s.top_p} if sample else {"temperature": None, "top_p": None}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=s.max_new_tokens,
                                      do_sample=sample, eos_token_id=sorted(self.eos), pad_token_id=self.pad,
                                      top_k=None, **extra)
        results = []
        for row in out[:, width:].tolist():
            stop = next((k for k, t in enumerate(row) if t in self.eos), None)
            results.append((row[:stop], "eos") if stop is not None else (row, "length"))
        return results

    def close(self) -> None:
        pass


class SGLangEngine:
    def __init__(self, target_path: str, s: Settings):
        from transformers import AutoTokenizer

        try:
            import torch

            cpu = not torch.cuda.is_available()
        except ImportError:
            cpu = True
        if cpu:  # SGLang's CPU path imports vllm._custom_ops.rotary_embedding (see the shim's README)
            sys.path.insert(0, str(SHIM_DIR))
            os.environ["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), os.environ.get("PYTHONPATH", "")])
        import sglang as sgl

        kwargs = dict(model_path=target_path, dtype=s.dtype, log_level="warning", skip_server_warmup=True,
                      random_seed=s.seed, trust_remote_code=s.trust_remote_code)
        if cpu:
            kwargs.update(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                          disable_cuda_graph=True, disable_overlap_schedule=True, disable_radix_cache=True,
                          mem_fraction_static=0.05, max_total_tokens=s.sglang_max_total_tokens)
        self.engine = sgl.Engine(**kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=s.trust_remote_code)

    def generate(self, prompts: list[list[int]], s: Settings) -> list[tuple[list[int], str]]:
        params = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p}
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        results = []
        for out in outs:
            finish = (out["meta_info"].get("finish_reason") or {}).get("type")
            ids = [t for t in out["output_ids"] if t not in self.tokenizer.all_special_ids]
            results.append((ids, "length" if finish == "length" else "eos"))
        return results

    def close(self) -> None:
        self.engine.shutdown()


def make_engine(target_path: str, s: Settings):
    return SGLangEngine(target_path, s) if s.backend == "sglang" else HFEngine(target_path, s)


def regenerate_conversations(engine, tokenizer, conversations: list[list[dict]], s: Settings) -> list[dict]:
    """Regenerated, tokenized conversations; each result has `status` ('ok' or a skip reason)."""
    states = []
    for messages in conversations:
        system = [m for m in messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        states.append({"history": [{"role": m["role"], "content": m["content"]} for m in system],
                       "users": users, "finish": [], "stopped": False})
    for t in range(max((len(st["users"]) for st in states), default=0)):
        batch = []
        for st in states:
            if st["stopped"] or t >= len(st["users"]):
                continue
            history = st["history"] + [{"role": "user", "content": st["users"][t]}]
            ids = generation_prompt_ids(tokenizer, history, **s.template_kwargs)
            if len(ids) >= s.max_length:  # no room left for an answer: later turns are cut
                st["stopped"] = True
                continue
            st["history"] = history
            batch.append((st, ids))
        if not batch:
            break
        for (st, _), (answer, finish) in zip(batch, engine.generate([ids for _, ids in batch], s)):
            text = tokenizer.decode(answer, skip_special_tokens=True)
            st["history"].append({"role": "assistant", "content": text})
            st["finish"].append(finish)
    return [_tokenize(tokenizer, st, s) for st in states]


def _tokenize(tokenizer, st: dict, s: Settings) -> dict:
    result = {"messages": st["history"], "finish": st["finish"][-1] if st["finish"] else None,
              "turns_cut": len(st["users"]) - len(st["finish"]), "input_ids": [], "loss_mask": [],
              "truncated": False, "status": "ok", "error": None}
    if not st["finish"]:
        result["status"] = "prompt_overlong"
        return result
    try:
        tok = tokenize_conversation(tokenizer, st["history"], keep_reasoning=s.keep_reasoning,
                                    end_of_turn=[f == "eos" for f in st["finish"]], **s.template_kwargs)
    except TemplateError as exc:
        result.update(status="mask_round_trip_failed", error=str(exc))
        return result
    fitted, reason = apply_length_policy(tok, s.max_length, s.overlong)
    if fitted is None:
        result["status"] = reason
        return result
    result.update(input_ids=fitted.input_ids, loss_mask=fitted.loss_mask,
                  truncated=len(fitted.input_ids) < len(tok.input_ids))
    return result


class Regenerator:
    """Ray Data callable class: one target engine per actor, a batch of conversations per call."""

    def __init__(self, target_path: str, settings: dict):
        self.s = Settings(**settings)
        self.engine = make_engine(target_path, self.s)
        self.tokenizer = self.engine.tokenizer
        check_template(self.tokenizer, **self.s.template_kwargs)  # refuse a template before any work

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist()
        results = regenerate_conversations(self.engine, self.tokenizer,
                                           [json.loads(r["messages_json"]) for r in rows], self.s)
        out = []
        for row, res in zip(rows, results):
            mask = res["loss_mask"]
            out.append({
                "id": row["id"], "dataset": row["dataset"], "split": row["split"], "shard": row["shard"],
                "status": res["status"], "error": res["error"], "finish": res["finish"],
                "truncated": res["truncated"], "turns_cut": res["turns_cut"],
                "messages_json": json.dumps(res["messages"], ensure_ascii=False),
                "input_ids": res["input_ids"], "loss_mask": mask,
                "prompt_tokens": len(mask) - sum(mask), "answer_tokens": sum(mask),
            })
        return pa.Table.from_pylist(out, schema=RESULT_SCHEMA())


def RESULT_SCHEMA():  # noqa: N802 - a schema constant, built lazily (pyarrow import)
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()), ("dataset", pa.string()), ("split", pa.string()), ("shard", pa.int64()),
        ("status", pa.string()), ("error", pa.string()), ("finish", pa.string()), ("truncated", pa.bool_()),
        ("turns_cut", pa.int64()), ("messages_json", pa.string()),
        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
        ("prompt_tokens", pa.int64()), ("answer_tokens", pa.int64()),
    ])
