"""Served tokens/s, single stream and concurrent, against a running SGLang or vLLM server.

    python -m workflows.tools.benchmark --url http://127.0.0.1:30000 --prompts data/prompts/default.jsonl \
        --concurrency 1 8 --runs 3 --max-new-tokens 2048 --out runs/x/benchmark/benchmark.json
    python -m workflows.tools.benchmark --prompts runs/x/report/prompts.jsonl --concurrency 1 --runs 8 --warmup 0
    python -m workflows.tools.benchmark --engine vllm --prompts runs/x/report/prompts.jsonl --concurrency 1 \
        --runs 8 --warmup 0

The second reads the report's 8 prompts (token ids and budgets, as the evaluate stage
served them), one per timed run: against `workflows.tools.serve` its accept length is the
report's served figure; the third does the same against the vLLM server the serve tool
starts for a DFlash draft.

Each timed run sends `concurrency` requests at once (prompts taken round-robin) and
divides the completion tokens by the wall time of the slowest; warmup runs go first and
are not counted. Long generations by default (2048 new tokens): reasoning models think
before they answer, and short runs flatter speculation. The accept length is each engine's
own figure, in its own definition (`accept_length_is` in the output says which):

* SGLang (`--engine sglang`): from its reply metadata (`meta_info.spec_accept_length`, or
  completion tokens / `spec_verify_ct`) on `/generate`; the OpenAI API
  (`/v1/completions`) returns none. The report's `acceptance_decoded_sglang_definition`
  is the comparable prediction.
* vLLM (`--engine vllm`, the OpenAI API): its speculative counters on its Prometheus
  `/metrics` endpoint, read before and after the timed runs of each concurrency
  (`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`):
  the mean acceptance length (accepted + drafts) / drafts and the tokens accepted at each
  draft position. The report's `acceptance_decoded_vllm_definition` is the comparable
  prediction. The counters are the server's, over every request it served meanwhile:
  benchmark a server nothing else is using.

Standard library HTTP only (and prometheus_client's text parser); loopback by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workflows.core.cli import reporting_errors
from workflows.core.config import resolve_data_path
from workflows.core.errors import InputError
from workflows.core.markers import write_json_atomic
from workflows.core.serving import DEFINITIONS, accept_length

ENGINES = {"sglang": "generate", "vllm": "openai"}  # engine -> its default API
VLLM_SPEC = "vllm:spec_decode_"  # vLLM's speculative counters (vllm/v1/spec_decode/metrics.py)
ACCEPT_LENGTH_IS = {
    "sglang": "completion tokens / verify passes (SGLang's spec_verify_ct), the prefill's token "
    "included: the report's acceptance_decoded_sglang_definition is the same figure",
    "vllm": DEFINITIONS["vllm"] + ", from its /metrics counters over the timed runs: the report's "
    "acceptance_decoded_vllm_definition is the same figure",
}


def _post(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str, timeout: float = 30) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def vllm_counters(url: str) -> dict:
    """vLLM's speculative counters from its Prometheus `/metrics`, summed over its engines:
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position"}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    per: dict[int, int] = {}
    for family in text_string_to_metric_families(_get(f"{url}/metrics").decode()):
        name = family.name.removeprefix(VLLM_SPEC)
        if family.type != "counter" or name == family.name:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                out[name] += int(sample.value)
            elif name == "num_accepted_tokens_per_pos":
                pos = int(sample.labels["position"])
                per[pos] = per.get(pos, 0) + int(sample.value)
    out["accepted_per_position"] = [per.get(i, 0) for i in range(max(per) + 1)] if per else []
    return out


def counters_between(before: dict, after: dict) -> dict:
    """What vLLM counted between two readings of `vllm_counters`, with its accept length
    and the part of drafts accepted at each position."""
    delta = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    old = before["accepted_per_position"] + [0] * (
        len(after["accepted_per_position"]) - len(before["accepted_per_position"])
    )
    delta["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], old)]
    drafts = delta["num_drafts"]
    delta["acceptance_rate_per_position"] = [a / drafts for a in delta["accepted_per_position"]] if drafts else []
    delta["accept_length"] = accept_length("vllm", delta) if drafts else None
    return delta


def served_model(url: str) -> str:
    """The first model an OpenAI server serves (vLLM names it by its --model path)."""
    models = json.loads(_get(f"{url}/v1/models"))["data"]
    if not models:
        raise InputError(f"{url}/v1/models lists no model")
    return models[0]["id"]


def wait_healthy(url: str, timeout_s: float = 300, proc=None) -> None:
    """Poll /health until 200; fail early if the server process died."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy:\n{err}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s} s")


def one_request(
    url: str, prompt: str | dict, max_new_tokens: int, api: str, model: str | None, ignore_eos: bool, timeout: float
) -> dict:
    """-> {completion_tokens, accept_length (or None), verify_passes (or None)}. A prompt is
    a text, or {"input_ids": [...], "max_new_tokens": n} (the report's prompts.jsonl rows:
    the same tokens, the same budget, hence the served check's figure)."""
    stop: list[int] = []
    if isinstance(prompt, dict) and prompt.get("max_new_tokens"):  # the row's own budget and stop tokens
        max_new_tokens, stop = int(prompt["max_new_tokens"]), list(prompt.get("stop_token_ids", []))
    if api == "generate":
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": ignore_eos}
        body = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt["input_ids"]}
        if stop:
            params["stop_token_ids"] = stop
        meta = _post(f"{url}/generate", {**body, "sampling_params": params}, timeout)["meta_info"]
        tokens = int(meta["completion_tokens"])
        verify = meta.get("spec_verify_ct")
        accept = meta.get("spec_accept_length")
        if accept is None and verify:
            accept = tokens / verify
        return {"completion_tokens": tokens, "accept_length": accept, "verify_passes": verify}
    if api == "openai":
        text = prompt if isinstance(prompt, str) else prompt["input_ids"]  # the completions API takes token ids too
        body = {"model": model or "default", "prompt": text, "max_tokens": max_new_tokens, "temperature": 0}
        if ignore_eos:
            body["ignore_eos"] = True  # SGLang's extension of the completions API
        if stop:
            body["stop_token_ids"] = stop  # an extension of SGLang and vLLM
        reply = _post(f"{url}/v1/completions", body, timeout)
        return {
            "completion_tokens": int(reply["usage"]["completion_tokens"]),
            "accept_length": None,
            "verify_passes": None,
        }
    raise ValueError(f"api={api!r}: expected 'generate' or 'openai'")


def timed_run(url, prompts, concurrency, start, **kw) -> dict:
    batch = [prompts[(start + i) % len(prompts)] for i in range(concurrency)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies = list(pool.map(lambda p: one_request(url, p, **kw), batch))
    seconds = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in replies)
    verify = [r["verify_passes"] for r in replies if r["verify_passes"]]
    accept = [r["accept_length"] for r in replies if r["accept_length"] is not None]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "verify_passes": sum(verify) if verify else None,
        "accept_lengths": accept,
    }


def run_benchmark(
    url: str,
    prompts: list[str | dict],
    max_new_tokens: int = 2048,
    warmup: int = 1,
    runs: int = 3,
    concurrency=(1, 8),
    api: str | None = None,
    model: str | None = None,
    ignore_eos: bool = False,
    timeout: float = 3600,
    engine: str = "sglang",
) -> dict:
    """`engine` ("sglang", "vllm") says where the accept length comes from (see the module
    docstring); `api` defaults to the engine's ("generate" for SGLang, "openai" for vLLM)."""
    if not prompts:
        raise ValueError("no prompts to benchmark with")
    if engine not in ENGINES:
        raise InputError(f"engine={engine!r}: expected one of {sorted(ENGINES)}")
    api = api or ENGINES[engine]
    if engine == "vllm" and api != "openai":
        raise InputError(f"api={api!r}: a vLLM server is read through the OpenAI API (api='openai')")
    if engine == "vllm" and model is None:
        model = served_model(url)
    kw = {"max_new_tokens": max_new_tokens, "api": api, "model": model, "ignore_eos": ignore_eos, "timeout": timeout}
    results = {}
    for c in concurrency:
        for w in range(warmup):
            timed_run(url, prompts, c, w, **kw)
        before = vllm_counters(url) if engine == "vllm" else None
        timed = [timed_run(url, prompts, c, warmup + r, **kw) for r in range(runs)]
        counted = counters_between(before, vllm_counters(url)) if engine == "vllm" else None
        rates = [t["tokens"] / t["seconds"] for t in timed]
        tokens = sum(t["tokens"] for t in timed)
        passes = [t["verify_passes"] for t in timed if t["verify_passes"]]
        accepts = [a for t in timed for a in t["accept_lengths"]]
        results[str(c)] = {
            "concurrency": c,
            "runs": runs,
            "completion_tokens": tokens,
            "tokens_per_s_mean": statistics.mean(rates),
            "tokens_per_s_stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            "tokens_per_s_per_stream": statistics.mean(rates) / c,
            # Tokens per verify pass over all timed requests when the server counts passes.
            "accept_length": (tokens / sum(passes))
            if passes and len(passes) == len(timed)
            else (statistics.mean(accepts) if accepts else None),
        }
        if counted is not None:  # vLLM's own counters over these timed runs
            results[str(c)]["accept_length"] = counted.pop("accept_length")
            results[str(c)]["vllm_counters"] = counted
    return {
        "url": url,
        "engine": engine,
        "api": api,
        "max_new_tokens": max_new_tokens,
        "warmup": warmup,
        "results": results,
        "accept_length_is": ACCEPT_LENGTH_IS[engine],
    }


def read_prompt_texts(path: Path, limit: int) -> list[str | dict]:
    """Prompts from a JSONL file of {"prompt": ...}, {"messages": [...]} or {"input_ids": [...]}
    rows (the last as the evaluate stage writes them, report/prompts.jsonl, kept whole)."""
    texts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
        if isinstance(row.get("input_ids"), list):
            if not row["input_ids"] or not all(isinstance(t, int) for t in row["input_ids"]):
                raise InputError(f"{path}:{n}: 'input_ids' must be a non-empty list of token ids")
            texts.append(row)
            if len(texts) == limit:
                break
            continue
        text = row.get("prompt") or next(
            (m.get("content") for m in row.get("messages", []) if m.get("role") == "user"), None
        )
        if not isinstance(text, str):
            raise InputError(f"{path}:{n}: no 'prompt' string, no user message and no 'input_ids'")
        texts.append(text)
        if len(texts) == limit:
            break
    return texts


@reporting_errors
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--prompts", default="data/prompts/default.jsonl")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="sglang",
        help="the server's engine: where the accept length comes from (vllm: its /metrics counters)",
    )
    p.add_argument(
        "--api", choices=["generate", "openai"], default=None, help="default: generate for sglang, openai for vllm"
    )
    p.add_argument("--model", default=None, help="model name for the OpenAI API")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--out",
        default=None,
        help="write the results here as JSON; <run_dir>/benchmark/benchmark.json is picked up by the report",
    )
    a = p.parse_args(argv)

    prompts = read_prompt_texts(resolve_data_path(a.prompts), a.limit)
    wait_healthy(a.url, timeout_s=60)
    res = run_benchmark(
        a.url,
        prompts,
        a.max_new_tokens,
        a.warmup,
        a.runs,
        a.concurrency,
        a.api,
        a.model,
        a.ignore_eos,
        engine=a.engine,
    )
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        write_json_atomic(Path(a.out), res)


if __name__ == "__main__":
    main()
