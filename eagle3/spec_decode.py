"""A reference speculative decoder: an HF target verifying an EAGLE-3 draft, greedily.

Chain drafting is tree drafting with `topk=1`, so one code path serves both:

* **Draft** (SGLang-like). The last committed draft row gives the first `topk` guesses.
  Each of the next `num_steps - 1` steps feeds the current frontier (the `topk` best
  leaves) to the draft in one block, under a tree mask (a node sees the committed rows,
  its ancestors and itself), and expands every frontier node by its `topk` best tokens;
  the `topk` best of those by cumulative log-probability form the next frontier. Of all
  candidates, the best `num_draft_tokens - 1` by cumulative log-probability are verified.
* **Verify**. One target forward over `[last token] + tree` with a 4D tree attention
  mask; walk from the root, following the child whose token is the target's greedy
  choice; the target's choice after the last accepted node is the bonus token. The target
  KV cache keeps only the accepted path. The output equals plain greedy decoding.
* **Commit**. Every verified row t feeds the draft (token x_{t+1}, fused target states of
  row t), as in training: draft rows always hold target states, never draft guesses.

`Eagle3Drafter(draft, sglang_compatible=True)` drafts trees (topk > 1) the way SGLang
0.5.23 does, which differs from the exact tree mask above in one respect: the draft's
attention over the *draft* tokens of the round. SGLang gives each of the `topk` frontier
ranks its own strip of KV slots (`out_cache_loc` viewed as [batch, topk, num_steps]), and
a node fed at step s with frontier rank r attends to the committed rows plus the slots of
rank r at steps 0..s, i.e. to the nodes that held rank r in the earlier frontiers, not to
its true ancestors (`generate_draft_decode_kv_indices` in
sglang/kernels/ops/speculative/cache_locs.py; ranks are the order of `select_top_k_tokens`,
best cumulative score first). Its hidden-state input is still its true parent's output
(`hidden_states[topk_cs_index // topk]`), and verification uses the true tree, so decoding
stays lossless; only the draft tokens, hence acceptance, can change. The depth-1 nodes are
fed first, with no draft slot before them, so the depth-2 candidates are the same in both
modes; a depth-2 node may then attend to its rank-mate instead of its parent, so from depth
3 on (num_steps >= 3) they can differ. Chains (topk = 1) are identical: rank 0 is the chain.
Read from SGLang 0.5.23's source (the version pinned here); its paged branch
(page_size > 1) also gives each rank its own slots.

Layer ids follow `eagle3.layer_ids` (id i = output of decoder layer i, -1 = embeddings),
captured by forward hooks. Batch size 1; this is a yardstick, not a server.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle3.attention import KVCache, _softmax_fp32, upcast
from eagle3.metrics import SlotCounts
from eagle3.target_features import LayerTap


@dataclass
class DraftTree:
    """Nodes in an order where parents come first; parent -1 is the root (the last token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 = first draft token

    def __len__(self) -> int:
        return len(self.tokens)


def check_tree_args(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    if num_steps < 1 or topk < 1:
        raise ValueError(f"num_steps={num_steps} and topk={topk} must be >= 1")
    most = topk + (num_steps - 1) * topk * topk
    if not 2 <= num_draft_tokens <= most + 1:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} must lie in 2..{most + 1} "
            f"(1 + topk + (num_steps-1)*topk^2 for num_steps={num_steps}, topk={topk})"
        )
    if topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"chain drafting (topk=1) verifies num_steps+1={num_steps + 1} tokens, "
            f"not num_draft_tokens={num_draft_tokens}"
        )


class Drafter(Protocol):
    def commit(self, tokens: list[int], aux: torch.Tensor) -> None: ...
    def propose(self, num_steps: int, topk: int, num_draft_tokens: int) -> DraftTree: ...
    def reset(self) -> None: ...


class TreeKVCache(KVCache):
    """KVCache whose next block may carry a mask over *all* keys (past and new)."""

    def __init__(self):
        super().__init__()
        self.full_mask: torch.Tensor | None = None  # [Tq, past + Tq] bool, used once

    def attend(self, q, k, v, mask=None):
        if self.full_mask is None:
            return super().attend(q, k, v, mask)
        full, self.full_mask = self.full_mask.to(q.device), None
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        scores = upcast(q @ self.k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return _softmax_fp32(scores.masked_fill(~full, float("-inf"))).to(self.v.dtype) @ self.v


class Eagle3Drafter:
    """Drafting with an `eagle3.modeling.Eagle3Draft` and its own KV cache."""

    def __init__(self, draft, sglang_compatible: bool = False):
        self.draft = draft.eval()
        # True: the draft's attention over this round's draft tokens follows SGLang's frontier
        # ranks rather than the true ancestors (see the module docstring). Same for chains.
        self.sglang_compatible = sglang_compatible
        self.reset()

    def reset(self) -> None:
        self.cache = TreeKVCache()
        self.rows = 0  # committed rows (target-verified)
        self.last_hidden = None

    @torch.no_grad()
    def commit(self, tokens: list[int], aux: torch.Tensor) -> None:
        """Append verified rows: tokens[i] follows the row whose target states are aux[i]."""
        self.cache.truncate(self.rows)  # drop the previous round's draft guesses
        n = len(tokens)
        hidden = self.draft.fuse(aux.reshape(1, n, -1))
        ids = torch.tensor([tokens], device=hidden.device)
        pos = torch.arange(self.rows, self.rows + n, device=hidden.device)[None]
        out = self.draft.step(ids, hidden, pos, self.cache)
        self.rows += n
        self.last_hidden = out[:, -1:]

    @torch.no_grad()
    def propose(self, num_steps: int, topk: int, num_draft_tokens: int) -> DraftTree:
        d = self.draft
        scores, tokens, parents, depths = [], [], [], []
        # Frontier: (candidate index, hidden state that produced it, cache row or None).
        logp = torch.log_softmax(upcast(d.logits(self.last_hidden))[0, -1], -1)
        top = logp.topk(topk)
        ids = d.draft_to_target(top.indices).tolist()
        frontier = []
        for lp, tok in zip(top.values.tolist(), ids):
            frontier.append(len(tokens))
            tokens.append(tok), parents.append(-1), depths.append(1), scores.append(lp)
        parent_hidden = {i: self.last_hidden[0, 0] for i in frontier}
        cache_row: dict[int, int] = {}  # candidate -> its key row in the draft cache
        rank_rows: list[list[int]] = []  # per earlier step: the cache row of each frontier rank
        for _ in range(1, num_steps):
            past = len(self.cache)
            block = len(frontier)
            mask = torch.zeros(block, past + block, dtype=torch.bool)
            mask[:, : self.rows] = True
            for r, c in enumerate(frontier):
                mask[r, past + r] = True
                if self.sglang_compatible:  # rank r sees the rank-r node of every earlier step
                    for rows in rank_rows:
                        mask[r, rows[r]] = True
                    continue
                a = parents[c]  # exact: the node's true ancestors
                while a != -1:
                    mask[r, cache_row[a]] = True
                    a = parents[a]
            rank_rows.append(list(range(past, past + block)))
            self.cache.full_mask = mask
            ids_t = torch.tensor([[tokens[c] for c in frontier]], device=self.last_hidden.device)
            hid = torch.stack([parent_hidden[c] for c in frontier])[None]
            pos = torch.tensor([[self.rows - 1 + depths[c] for c in frontier]], device=hid.device)
            out = d.step(ids_t, hid, pos, self.cache)[0]  # [block, H]
            for r, c in enumerate(frontier):
                cache_row[c] = past + r
            logp = torch.log_softmax(upcast(d.logits(out)), -1)  # [block, Vd]
            top = logp.topk(topk, dim=-1)
            children = []
            for r, c in enumerate(frontier):
                for lp, tok in zip(top.values[r].tolist(), d.draft_to_target(top.indices[r]).tolist()):
                    children.append(len(tokens))
                    tokens.append(tok), parents.append(c), depths.append(depths[c] + 1)
                    scores.append(scores[c] + lp)
                    parent_hidden[len(tokens) - 1] = out[r]
            frontier = sorted(children, key=lambda i: (-scores[i], i))[:topk]
        return select_tree(tokens, parents, depths, scores, num_draft_tokens - 1)


def select_tree(tokens, parents, depths, scores, keep: int) -> DraftTree:
    """The `keep` best candidates by cumulative log-prob; a parent never scores below its
    child, and ties go to the shallower node, so the choice is ancestor-closed."""
    best = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:keep]
    chosen = set(best)
    for i in best:
        if parents[i] != -1 and parents[i] not in chosen:
            raise AssertionError(f"draft tree selection is not ancestor-closed at candidate {i}")
    order = sorted(best, key=lambda i: (depths[i], i))
    where = {c: j for j, c in enumerate(order)}
    return DraftTree(
        tokens=[tokens[c] for c in order],
        parents=[-1 if parents[c] == -1 else where[parents[c]] for c in order],
        depths=[depths[c] for c in order],
    )


class TargetRunner:
    """An HF causal LM with a DynamicCache and hooks capturing the draft's layer ids."""

    def __init__(self, model, capture_ids: list[int]):
        self.model = model.eval()
        self.tap = LayerTap(model, capture_ids)
        self.reset()

    def close(self) -> None:
        self.tap.close()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.no_grad()
    def forward(self, tokens: list[int], positions: list[int], mask: torch.Tensor | None = None):
        """-> (next-token logits per row [T, V], aux states [T, n*H]). `mask`: [T, past+T] bool."""
        dev = self.model.device
        ids = torch.tensor([tokens], device=dev)
        kwargs = {}
        if mask is not None:
            dtype = self.model.get_input_embeddings().weight.dtype
            additive = torch.zeros(mask.shape, dtype=dtype, device=dev)
            additive.masked_fill_(~mask.to(dev), torch.finfo(dtype).min)
            kwargs["attention_mask"] = additive[None, None]
        out = self.model(
            input_ids=ids,
            position_ids=torch.tensor([positions], device=dev),
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[0], self.tap.aux()[0]

    def keep_rows(self, past: int, rows: list[int]) -> None:
        """Keep the first `past` cached positions plus the new block's `rows`."""
        if rows == list(range(len(rows))):  # a chain prefix: drop the tail in place
            # crop(-n) drops the last n (a positive size is deprecated since transformers 5.17).
            surplus = self.cache.get_seq_length() - (past + len(rows))
            if surplus > 0:
                self.cache.crop(-surplus)
            self.length = past + len(rows)
            return
        idx = torch.tensor(list(range(past)) + [past + r for r in rows], device=self.model.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)
        self.length = past + len(rows)


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    target_forwards: int  # verify forwards (the prefill not counted)
    gained: int  # tokens produced by verify forwards
    slots: SlotCounts  # rounds whose accepted path reached draft depth i+1, and accepted there
    seconds: float
    # Draft tokens the target accepted, counted before the output is cut at max_new_tokens
    # or EOS: what vLLM's spec-decode counters count.
    accepted_uncut: int = 0
    # Draft tokens sent to the target to verify (a pass's tree or chain, after any adaptive cut).
    drafted: int = 0

    @property
    def acceptance_length(self) -> float:
        return self.gained / self.target_forwards if self.target_forwards else float("nan")


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """The target's token for each row [T, V]: its argmax at temperature 0, else a sample
    from softmax(logits / temperature), each row independently."""
    if temperature == 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(upcast(logits) / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).flatten().tolist()  # generator on probs' device


class SpeculativeDecoder:
    """Verification draws the target's own token at each verified row (its argmax at
    temperature 0, a sample at `temperature` > 0, from `generator`) and walks into the child
    that guessed it: with drafts chosen deterministically (top-k, as SGLang and vLLM draft),
    this is the accept/resample rule of speculative sampling (a draft token y is accepted
    with probability p(y); on rejection the token comes from p without the rejected
    children), so the output is distributed as plain sampling from the target."""

    def __init__(
        self,
        target_model,
        drafter: Drafter,
        capture_ids: list[int],
        num_steps: int,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        eos_token_ids=(),
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        num_draft_tokens = num_steps + 1 if num_draft_tokens is None else num_draft_tokens
        check_tree_args(num_steps, topk, num_draft_tokens)
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0")
        self.target = TargetRunner(target_model, capture_ids)
        self.drafter = drafter
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.eos = set(eos_token_ids)
        self.temperature, self.generator = temperature, generator

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        if len(prompt) < 1 or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        t0 = time.perf_counter()
        tgt, drafter = self.target, self.drafter
        tgt.reset(), drafter.reset()
        logits, aux = tgt.forward(prompt, list(range(len(prompt))))
        tgt.length = len(prompt)
        out = choose(logits[-1:], self.temperature, self.generator)
        drafter.commit(list(prompt[1:]) + out, aux)
        res = DecodeResult([], 0, 0, SlotCounts.zeros(self.num_steps), 0.0)
        while len(out) < max_new_tokens and out[-1] not in self.eos:
            tree = drafter.propose(self.num_steps, self.topk, self.num_draft_tokens)
            past, q = tgt.length, len(tree) + 1
            res.drafted += len(tree)
            mask = torch.zeros(q, past + q, dtype=torch.bool)
            mask[:, :past] = True
            for r in range(q):
                node = r
                while node >= 0:  # the row itself and its ancestors; row 0 is the root
                    mask[r, past + node] = True
                    node = tree.parents[node - 1] + 1 if node > 0 else -1
            logits, aux = tgt.forward([out[-1]] + tree.tokens, [past] + [past + d for d in tree.depths], mask)
            picked = choose(logits, self.temperature, self.generator)  # the target's token after each row
            path, cur = [0], 0
            while True:
                nxt = [j + 1 for j, p in enumerate(tree.parents) if p + 1 == cur and tree.tokens[j] == picked[cur]]
                if not nxt:
                    break
                cur = nxt[0]
                path.append(cur)
            new = [tree.tokens[r - 1] for r in path[1:]] + [picked[cur]]
            # Drafts past the requested length are not scored (as the offline walk, whose
            # text ends there, cannot score them).
            remaining = max_new_tokens - len(out)
            res.slots.record(min(len(path) - 1, remaining), remaining)
            res.accepted_uncut += len(path) - 1
            tgt.keep_rows(past, path)
            drafter.commit(new, aux[path])
            new = truncate_at_eos(new, self.eos)[: max_new_tokens - len(out)]
            res.gained += len(new)
            res.target_forwards += 1
            out.extend(new)
        res.tokens = truncate_at_eos(out[:max_new_tokens], self.eos)
        res.seconds = time.perf_counter() - t0
        return res


def truncate_at_eos(tokens: list[int], eos) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def greedy_decode(
    target_model,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_ids=(),
    margins: list | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], float]:
    """Plain decoding with a KV cache, one target forward per token: the reference output
    and the baseline speed; greedy, or sampled at `temperature` > 0. `margins`, when given,
    receives (top-1 logit, top-1 minus top-2) at each generated position (how close the
    greedy choice was to a tie). -> (generated tokens, seconds)."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    eos = set(eos_token_ids)
    cache = DynamicCache(config=target_model.config)
    dev = target_model.device

    def pick(logits) -> int:
        if margins is not None:
            top = upcast(logits[0, -1]).topk(2).values.tolist()
            margins.append((top[0], top[0] - top[1]))
        return choose(logits[0, -1:], temperature, generator)[0]

    logits = target_model(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True).logits
    out = [pick(logits)]
    while len(out) < max_new_tokens and out[-1] not in eos:
        logits = target_model(
            input_ids=torch.tensor([[out[-1]]], device=dev), past_key_values=cache, use_cache=True
        ).logits
        out.append(pick(logits))
    return out, time.perf_counter() - t0
