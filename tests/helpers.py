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
        "chain": decode_all figures for num_steps 3, "tree": for topk 4 / 16 draft tokens in
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
    tree = decode_all(  # the seed deployment's serving shape: 16 draft tokens per verify
        model, draft, rows, layers, num_steps=3, topk=4, num_draft_tokens=16, eos=[], sglang_compatible=True
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


def corpus_overrides(tiny_target, run_dir) -> list[str]:
    """The `corpus` fixture's data: 12 conversations of the tiny target, fp32, shards of 3."""
    return [
        "target=tiny",
        "mixture=bundled",
        f"cache_dir={tiny_target.parent.parent}",
        f"run_dir={run_dir}",
        "data.limit=12",
        "data.max_new_tokens=16",
        "data.heldout_fraction=0.25",
        "capture.shard_samples=3",
        "capture.micro_batch_tokens=256",
        "cluster.dashboard=false",
        "data.dtype=float32",
        "capture.dtype=float32",
    ]


def cfg_for(tiny_target, run_dir, *extra):
    """The capture tests' config: the corpus's data, two shards a call, a 2-CPU Ray."""
    from workflows.core.config import compose

    return compose([*corpus_overrides(tiny_target, run_dir), "capture.shards_per_call=2", "cluster.num_cpus=2", *extra])


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
        "block_draft": draft,
        "rows": rows,
        "prompts": [s[:prompt_len] for s in seqs],
        "greedy": chain["greedy"],
        "max_new_tokens": [new_tokens] * len(seqs),
        "chain": chain,
    }


# ------------------------------------------------------------------ DSpark, as vLLM 0.32 serves it
def dspark_checkpoint(
    dflash_export,
    target_path,
    folder,
    sample_from_anchor: bool,
    markov_w1: torch.Tensor | None = None,
    markov_w2: torch.Tensor | None = None,
    rank: int = 8,
):
    """A Qwen3 DSpark checkpoint for vLLM (method "dspark", `Qwen3DSparkModel`) made of a
    DFlash export (eagle3.dflash.export) and a Markov head: the same backbone weights, `d2t`
    and `lm_head`, plus `markov_head.markov_w1.weight` [vocab, rank] (indexed by target ids)
    and `markov_head.markov_w2.weight` [draft vocab, rank] (zeros unless given: a zero bias).
    vLLM's DSpark loader drops `mask_embedding` and never reads mask_embedding.pt, so the
    mask slots are embedded through the checkpoint's own `embed_tokens`: the target's table
    with the trained mask embedding in row mask_token_id. A test stand-in for the training
    side's export (eagle3/dspark), not a format of the project's own."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, folder = Path(dflash_export), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    mask = torch.load(src / "mask_embedding.pt", weights_only=True)
    embed = load_file(str(Path(target_path) / "model.safetensors"))["model.embed_tokens.weight"].clone()
    embed[mask["mask_token_id"]] = mask["embedding"].to(embed.dtype)
    state["embed_tokens.weight"] = embed
    vocab, draft_vocab = cfg["vocab_size"], cfg["draft_vocab_size"]
    state["markov_head.markov_w1.weight"] = torch.zeros(vocab, rank) if markov_w1 is None else markov_w1
    state["markov_head.markov_w2.weight"] = torch.zeros(draft_vocab, rank) if markov_w2 is None else markov_w2
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        markov_rank=int(state["markov_head.markov_w1.weight"].shape[1]),
        markov_head_type="vanilla",
        sample_from_anchor=sample_from_anchor,
        enable_confidence_head=False,
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


class DSparkReferenceDrafter:
    """vLLM 0.32's DSpark draft step (v1/worker/gpu/spec_decode/dspark/speculator.py), greedy,
    written plainly over a DFlash backbone (eagle3.dflash.drafter's context cache), for the
    reference decoder. Verified rows 0..n-1 are the context; the anchor (the target's token
    after row n-1) sits at position n, and draft token i is the guess for position n+1+i.
    Fill-in layout (`sample_from_anchor=False`, DFlash's): [anchor, mask x N] at n..n+N, and
    mask slot i+1 (position n+1+i) guesses the token at its own position. Anchor layout
    (True, the paper's): [anchor, mask x (N-1)] at n..n+N-1, and slot i (position n+i)
    guesses the next position, the anchor itself the first. Then left to right, draft token
    i is the argmax over the draft vocabulary of base_logits_i + w2 @ w1[prev], prev being
    the anchor for i = 0 and draft token i-1 (a target id) after."""

    def __init__(self, draft, markov_w1: torch.Tensor, markov_w2: torch.Tensor, sample_from_anchor: bool):
        from eagle3.dflash.drafter import DFlashDrafter

        self.backbone = DFlashDrafter(draft)
        self.w1, self.w2, self.sample_from_anchor = markov_w1.float(), markov_w2.float(), sample_from_anchor

    def reset(self) -> None:
        self.backbone.reset()

    def commit(self, tokens, aux) -> None:
        self.backbone.commit(tokens, aux)

    @torch.no_grad()
    def propose(self, num_steps: int, topk: int, num_draft_tokens: int):
        from eagle3.dflash.model import BlockVisibility
        from eagle3.spec_decode import DraftTree

        b = self.backbone
        d, rows = b.draft, b.rows
        slots = num_steps if self.sample_from_anchor else num_steps + 1
        ids = torch.full((1, 1, slots), d.cfg.mask_token_id, dtype=torch.long)
        ids[0, 0, 0] = b.anchor
        pos = torch.arange(rows, rows + slots)[None, None]
        visible = BlockVisibility(torch.full((1, 1), rows - 1), torch.zeros(1, rows, dtype=torch.long))
        hidden = d.blocks(ids, pos, list(zip(b.keys, b.values)), visible)[0, 0]
        base = d.logits(hidden if self.sample_from_anchor else hidden[1:])
        prev, guesses = b.anchor, []
        for i in range(num_steps):
            prev = int(d.draft_to_target((base[i] + self.w2 @ self.w1[prev]).argmax()))
            guesses.append(prev)
        return DraftTree(tokens=guesses, parents=list(range(-1, num_steps - 1)), depths=list(range(1, num_steps + 1)))


def dspark_reference(memorised_blocks, markov_w1, markov_w2, sample_from_anchor: bool, num_steps: int = 4) -> dict:
    """The reference decoder with `DSparkReferenceDrafter` on the memorised block draft's
    prompts: vLLM's counters as it counts them (drafts = verify passes, accepted drafts
    before the cut at the answer's length) and whether it is plain greedy decoding."""
    from eagle3.spec_decode import SpeculativeDecoder

    draft = memorised_blocks["block_draft"]
    drafter = DSparkReferenceDrafter(draft, markov_w1, markov_w2, sample_from_anchor)
    decoder = SpeculativeDecoder(memorised_blocks["model"], drafter, list(draft.cfg.capture_layer_ids), num_steps)
    drafts = accepted = 0
    outputs = []
    try:
        for prompt, n in zip(memorised_blocks["prompts"], memorised_blocks["max_new_tokens"]):
            res = decoder.generate(prompt, n)
            drafts, accepted = drafts + res.target_forwards, accepted + res.accepted_uncut
            outputs.append(res.tokens)
    finally:
        decoder.target.close()
    return {
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "acceptance_vllm": (accepted + drafts) / drafts,
        "lossless": outputs == memorised_blocks["greedy"],
    }


def bigram_markov_head(memorised_blocks, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A Markov head that has learnt the memorised answers' bigrams: w1 [vocab, draft vocab]
    is one where the draft id of a token that follows `a` (prompt and answer) meets row `a`,
    w2 = scale x identity (rank = the draft vocabulary). Its bias alone drafts those texts
    well in the anchor layout, where the fill-in draft's own slots guess one position off."""
    draft = memorised_blocks["block_draft"]
    draft_ids = {int(t): i for i, t in enumerate(draft.draft_to_target(torch.arange(draft.d2t.numel())).tolist())}
    w1 = torch.zeros(draft.cfg.vocab_size, draft.d2t.numel())
    for prompt, answer in zip(memorised_blocks["prompts"], memorised_blocks["greedy"]):
        text = prompt + answer
        for a, b in zip(text, text[1:]):
            if b in draft_ids:
                w1[a, draft_ids[b]] = 1.0
    return w1, torch.eye(draft.d2t.numel()) * scale
