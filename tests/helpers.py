"""Small builders shared by the maths tests (random drafts and a random HF target)."""
from __future__ import annotations

import torch

from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft


def tiny_draft_config(**over) -> DraftConfig:
    base = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, vocab_size=97, draft_vocab_size=40, target_hidden_size=24,
        target_num_layers=6, capture_layer_ids=[0, 2, 4], rope_theta=10000.0,
    )
    base.update(over)
    cfg = DraftConfig(**base)
    cfg.validate()
    return cfg


def random_draft(cfg: DraftConfig, seed: int = 0, dtype=torch.float64) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))  # non-trivial norm weights
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5) * 3)
        draft.embed_tokens.weight.copy_(torch.randn_like(draft.embed_tokens.weight))
    return draft.to(dtype).eval()


def tiny_hf_llama(num_layers=6, hidden=24, vocab=97, seed=0, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return model


def corpus_rows(run_dir) -> list[dict]:
    """The committed corpus of a run folder (its generate stage), as later stages read it."""
    from pathlib import Path

    from workflows.core.layout import RunLayout

    return RunLayout(Path(run_dir), str(Path(run_dir) / "store")).read_corpus()


def kill_run(proc, timeout: float = 60) -> None:
    """SIGKILL a run started with `start_new_session=True`: its process group, then every
    process left in its session (Ray's raylet and workers are not all in the group, and
    would otherwise go on working for seconds), until none is left."""
    import os
    import signal
    import subprocess
    import time

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], capture_output=True)
        alive = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of the killed run's session {proc.pid} still alive: {alive}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server or a Ray head a test starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
