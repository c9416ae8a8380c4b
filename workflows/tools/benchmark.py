"""Served tokens/s, single stream and concurrent, against a running SGLang server.

    python -m workflows.tools.benchmark --url http://127.0.0.1:30000 --prompts data/prompts/default.jsonl \
        --concurrency 1 8 --runs 3 --max-new-tokens 2048 --out runs/x/benchmark/benchmark.json
    python -m workflows.tools.benchmark --prompts runs/x/report/prompts.jsonl --concurrency 1 --runs 8 --warmup 0

The second reads the report's 8 prompts (token ids and budgets, as the evaluate stage
served them), one per timed run: against `workflows.tools.serve` its accept length is the
report's served figure.

Each timed run sends `concurrency` requests at once (prompts taken round-robin) and
divides the completion tokens by the wall time of the slowest; warmup runs go first and
are not counted. Long generations by default (2048 new tokens): reasoning models think
before they answer, and short runs flatter speculation. The accept length comes from
SGLang's reply metadata (`meta_info.spec_accept_length`, or completion tokens /
`spec_verify_ct`) on `/generate`; the OpenAI API (`/v1/completions`) returns none.
Standard library HTTP only; loopback by default.
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


def _post(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


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
    api: str = "generate",
    model: str | None = None,
    ignore_eos: bool = False,
    timeout: float = 3600,
) -> dict:
    if not prompts:
        raise ValueError("no prompts to benchmark with")
    kw = {"max_new_tokens": max_new_tokens, "api": api, "model": model, "ignore_eos": ignore_eos, "timeout": timeout}
    results = {}
    for c in concurrency:
        for w in range(warmup):
            timed_run(url, prompts, c, w, **kw)
        timed = [timed_run(url, prompts, c, warmup + r, **kw) for r in range(runs)]
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
    return {
        "url": url,
        "api": api,
        "max_new_tokens": max_new_tokens,
        "warmup": warmup,
        "results": results,
        "accept_length_is": "completion tokens / verify passes (SGLang's spec_verify_ct), the prefill's token "
        "included: the report's acceptance_decoded_sglang_definition is the same figure",
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
    p.add_argument("--api", choices=["generate", "openai"], default="generate")
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
    res = run_benchmark(a.url, prompts, a.max_new_tokens, a.warmup, a.runs, a.concurrency, a.api, a.model, a.ignore_eos)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        write_json_atomic(Path(a.out), res)


if __name__ == "__main__":
    main()
