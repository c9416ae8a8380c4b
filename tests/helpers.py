"""Small builders shared by the maths tests (random drafts and a random HF target)."""

from __future__ import annotations

import torch

from eagle3.draft_config import DraftConfig
from eagle3.modeling import Eagle3Draft


def tiny_draft_config(**over) -> DraftConfig:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=97,
        draft_vocab_size=40,
        target_hidden_size=24,
        target_num_layers=6,
        capture_layer_ids=[0, 2, 4],
        rope_theta=10000.0,
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


class LogitDraft:
    """A stand-in draft for score_steps: the hidden state *is* the logits over a draft
    vocabulary of `size` tokens, draft id i is target id i + 10, and target ids 10..9+size
    are the draft vocabulary (t2d over 20 target ids)."""

    def __init__(self, size: int = 2):
        self.t2d = torch.zeros(20, dtype=torch.bool)
        self.t2d[10 : 10 + size] = True

    def logits(self, h):
        return h

    def draft_to_target(self, ids):
        return ids + 10


def tiny_hf_llama(num_layers=6, hidden=24, vocab=97, seed=0, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
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

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already; its session may not be
        pass
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


def greedy_answers(model, layers, prompts: int, prompt_len: int, new_tokens: int):
    """The target's greedy answers to `prompts` random prompts (seeded), their loss masks
    and their states at `layers` in batches of 4 -> (sequences, masks, batches)."""
    from eagle3.target_features import capture_batch

    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(prompts):
        prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        seqs.append(out[0].tolist())
    masks = [[0] * prompt_len + [1] * new_tokens for _ in seqs]
    batches = [
        capture_batch(model, seqs[i : i + 4], masks[i : i + 4], layers, dtype=torch.float32)
        for i in range(0, len(seqs), 4)
    ]
    return seqs, masks, batches


def save_test_draft(draft, folder, target_path, layers) -> None:
    """A draft folder as the train stage writes one, with the provenance the exports read."""
    from pathlib import Path

    from workflows.core.draft_files import save_draft
    from workflows.core.provenance import target_identity

    prov = {
        "target": target_identity(Path(target_path), Path(folder).parent / "cache"),
        "capture_layer_ids": layers,
        "layer_id_convention": "output_of_layer",
        "hidden_size": draft.cfg.target_hidden_size,
    }
    save_draft(Path(folder), draft, prov)


def memorising_draft(
    target_path, folder, steps: int = 300, prompts: int = 8, prompt_len: int = 8, new_tokens: int = 32
) -> dict:
    """A draft that accepts far above 1 on known prompts, exported for SGLang and vLLM: the
    tiny target's greedy answers to `prompts` random prompts, their states captured, and a
    draft trained on them until it has learnt them (the served tests need acceptance well
    above 1, where a wrong layer mapping shows; the answers are its own training data).

    -> {"draft", "sglang", "vllm": folders, "prompts", "greedy": [[ids]], "max_new_tokens",
        "chain": decode_all figures for num_steps 3, "tree": for topk 2 / 6 draft tokens in
        SGLang's draft attention, "model": the HF target}"""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from eagle3.draft_config import DraftConfig
    from eagle3.target_head import TargetHead
    from eagle3.training import LoopConfig, OptimConfig, train_in_memory
    from eagle3.ttt import TTTConfig
    from eagle3.vocab import build_draft_vocab, count_tokens
    from workflows.evaluate import decode_all
    from workflows.export import export_sglang, export_vllm

    folder, layers = Path(folder), [0, 2, 4]
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    seqs, masks, batches = greedy_answers(model, layers, prompts, prompt_len, new_tokens)
    c = model.config
    cfg = DraftConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=512,
        target_hidden_size=c.hidden_size,
        target_num_layers=c.num_hidden_layers,
        capture_layer_ids=layers,
        rope_theta=c.rope_parameters["rope_theta"],
    )
    draft = Eagle3Draft(cfg)
    draft.load_target_embeddings(model.get_input_embeddings().weight.float())
    counts = sum(count_tokens(b["input_ids"], b["attention_mask"].long(), c.vocab_size) for b in batches)
    vocab = build_draft_vocab(counts, 512, warn=lambda m: None)
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    loop = LoopConfig(
        steps=steps,
        ttt=TTTConfig(length=4, decay=0.8),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
        compute_dtype="float32",
        log_every=10**6,
    )
    train_in_memory(draft, TargetHead(model.lm_head.weight.float()), batches, loop)
    draft = draft.float().eval()
    save_test_draft(draft, folder / "draft", target_path, layers)
    sglang = export_sglang(folder / "draft", folder / "sglang", "float32")
    vllm = export_vllm(sglang, folder / "vllm", Path(target_path), layers)
    rows = [{"id": str(i), "input_ids": s, "loss_mask": m} for i, (s, m) in enumerate(zip(seqs, masks))]
    chain = decode_all(model, draft, rows, layers, num_steps=3, topk=1, num_draft_tokens=None, eos=[])
    tree = decode_all(
        model, draft, rows, layers, num_steps=3, topk=2, num_draft_tokens=6, eos=[], sglang_compatible=True
    )
    return {
        "draft": folder / "draft",
        "sglang": sglang,
        "vllm": vllm,
        "model": model,
        "prompts": [s[:prompt_len] for s in seqs],
        "greedy": chain["greedy"],
        "max_new_tokens": [new_tokens] * len(seqs),
        "chain": chain,
        "tree": tree,
    }


def contract_of(cfg, identity) -> dict:
    """The capture contract of a whole config (its target and capture sections)."""
    from workflows.core.provenance import capture_contract

    return capture_contract(cfg.target, cfg.capture, identity, cfg.store_capture_ids)


def cfg_for(tiny_target, run_dir, *extra):
    """The capture tests' config: 12 conversations of the tiny target, fp32, shards of 3."""
    from workflows.core.config import compose

    return compose(
        [
            "target=tiny",
            "mixture=bundled",
            f"cache_dir={tiny_target.parent.parent}",
            f"run_dir={run_dir}",
            "data.limit=12",
            "data.max_new_tokens=16",
            "data.heldout_fraction=0.25",
            "capture.shard_samples=3",
            "capture.shards_per_call=2",
            "capture.micro_batch_tokens=256",
            "cluster.dashboard=false",
            "cluster.num_cpus=2",
            "data.dtype=float32",
            "capture.dtype=float32",
            *extra,
        ]
    )


def run_dir_with_corpus(corpus, tmp_path):
    """A run folder holding a copy of the `corpus` fixture's generated corpus."""
    import shutil

    shutil.copytree(corpus / "generate", tmp_path / "generate")
    return tmp_path


def memorising_block_draft(
    target_path, folder, steps: int = 400, prompts: int = 8, prompt_len: int = 8, new_tokens: int = 32
) -> dict:
    """The block-draft twin of `memorising_draft`: a DFlash draft (2 layers, blocks of 5,
    on layers [1, 2, 3]) trained on the tiny target's greedy answers to `prompts` random
    prompts until it has learnt them, exported for vLLM (workflows.export.export_dflash).

    -> {"draft", "vllm": folders, "prompts", "greedy", "max_new_tokens", "chain": decode_all
        figures for num_steps 4, "model": the HF target}"""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from eagle3.dflash.blocks import score_blocks, slot_decay
    from eagle3.dflash.config import DFlashConfig
    from eagle3.dflash.model import DFlashDraft
    from eagle3.target_head import TargetHead
    from eagle3.ttt import step_weights
    from eagle3.vocab import build_draft_vocab, count_tokens
    from workflows.evaluate import decode_all
    from workflows.export import export_dflash

    folder, layers = Path(folder), [1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    seqs, masks, batches = greedy_answers(model, layers, prompts, prompt_len, new_tokens)
    c = model.config
    counts = sum(count_tokens(b["input_ids"], b["attention_mask"].long(), c.vocab_size) for b in batches)
    vocab = build_draft_vocab(counts, 256, warn=lambda m: None)
    cfg = DFlashConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        num_layers=2,
        vocab_size=c.vocab_size,
        draft_vocab_size=256,
        target_hidden_size=c.hidden_size,
        target_num_layers=c.num_hidden_layers,
        capture_layer_ids=layers,
        block_size=5,
        mask_token_id=int((~vocab.t2d).nonzero().max()),
        rope_theta=c.rope_parameters["rope_theta"],
    )
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    draft.load_target_embeddings(model.get_input_embeddings().weight.float())
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    head = TargetHead(model.lm_head.weight.float())
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    anchors = torch.Generator().manual_seed(0)
    draft.train()
    for step in range(steps):
        b = batches[step % len(batches)]
        probs, best = head(b["final"], draft.target_ids())
        w = step_weights(b["loss_mask"], b["attention_mask"], cfg.block_size - 1)
        loss = score_blocks(
            draft, probs, best, w, b, b["aux"], decay=slot_decay(4.0), anchors=16, generator=anchors
        ).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft = draft.float().eval()
    save_test_draft(draft, folder / "draft", target_path, layers)
    vllm = export_dflash(folder / "draft", folder / "vllm", "float32")
    rows = [{"id": str(i), "input_ids": s, "loss_mask": m} for i, (s, m) in enumerate(zip(seqs, masks))]
    chain = decode_all(model, draft, rows, layers, num_steps=4, topk=1, num_draft_tokens=None, eos=[])
    return {
        "draft": folder / "draft",
        "vllm": vllm,
        "model": model,
        "prompts": [s[:prompt_len] for s in seqs],
        "greedy": chain["greedy"],
        "max_new_tokens": [new_tokens] * len(seqs),
        "chain": chain,
    }
