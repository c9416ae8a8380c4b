"""The reference speculative decoder is lossless and counts acceptance right."""

import pytest
import torch

from eagle3.attention import KVCache
from eagle3.spec_decode import DraftTree, Eagle3Drafter, SpeculativeDecoder, check_tree_args, greedy_decode, select_tree
from tests.helpers import random_draft, tiny_draft_config, tiny_hf_llama

LAYERS = [0, 2, 4]
VOCAB = 97


class OracleDrafter:
    """Knows the greedy continuation: `right` drafts it, otherwise every guess is wrong.
    Each depth also gets a wrong sibling placed *before* the right one, so the verifier
    must follow the token, not the position."""

    def __init__(self, reference: list[int], right: bool):
        self.ref, self.right = reference, right

    def reset(self):
        self.known = 1

    def commit(self, tokens, aux):
        assert aux.shape[0] == len(tokens)
        self.known += len(tokens)

    def propose(self, num_steps, topk, num_draft_tokens):
        tree = DraftTree()
        parent = -1
        for depth in range(1, num_steps + 1):
            pos = self.known + depth - 1
            good = self.ref[pos] if pos < len(self.ref) else 0
            bad = (good + 1) % VOCAB
            for tok in [bad, good] if topk > 1 else [good if self.right else bad]:
                if len(tree) == num_draft_tokens - 1:
                    return tree
                tree.tokens.append(tok if self.right or tok == bad else (good + 2) % VOCAB)
                tree.parents.append(parent)
                tree.depths.append(depth)
            parent = len(tree) - 1
        return tree


def prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.fixture(scope="module")
def target():
    return tiny_hf_llama(num_layers=6, hidden=24, vocab=VOCAB, dtype=torch.float64)


def test_plain_greedy_matches_hf_generate(target):
    for p in prompts(4):
        ours, _ = greedy_decode(target, p, 20)
        hf = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        assert ours == hf


@pytest.mark.parametrize(
    "steps,topk,ndt,norms",
    [
        (1, 1, 2, {}),
        (3, 1, 4, {"fc_norm": True}),
        (5, 1, 6, {}),
        (3, 2, 6, {"norm_before_fc": True}),
        (2, 3, 8, {}),
        (4, 4, 12, {}),
    ],
)
def test_eagle3_draft_decoding_is_lossless(target, steps, topk, ndt, norms):
    """Lossless for any draft, the feature norms before fc included (the decoder fuses with them)."""
    draft = random_draft(tiny_draft_config(target_hidden_size=24, **norms), seed=steps + topk)
    dec = SpeculativeDecoder(target, Eagle3Drafter(draft), LAYERS, num_steps=steps, topk=topk, num_draft_tokens=ndt)
    for p in prompts(10, seed=steps * 10 + topk):
        ref, _ = greedy_decode(target, p, 25)
        res = dec.generate(p, 25)
        assert res.tokens == ref, (p, steps, topk)
        assert res.gained == 24  # every token after the prefill's came from a verify pass
        assert 1 <= res.acceptance_length <= steps + 1


@pytest.mark.parametrize("steps,topk,ndt", [(4, 1, 5), (3, 2, 7), (3, 2, 4)])
def test_perfect_and_useless_drafts(target, steps, topk, ndt):
    for p in prompts(6, seed=3):
        ref, _ = greedy_decode(target, p, 40)
        full, ref = p + ref, ref[:30]
        perfect = SpeculativeDecoder(target, OracleDrafter(full, True), LAYERS, steps, topk, ndt)
        res = perfect.generate(p, 30)
        assert res.tokens == ref
        depth = min(steps, ndt - 1 if topk == 1 else (ndt - 1) // 2)  # length of the right path
        # Every pass accepts the whole right path and adds the bonus (the last may be cut short).
        assert res.target_forwards == -(-29 // (depth + 1))
        # Slot i counts as accepted while the pass still had more than i tokens to produce.
        left = [29 - (depth + 1) * j for j in range(res.target_forwards)]
        assert res.slots.accepted[:depth] == [sum(min(depth, r) > i for r in left) for i in range(depth)]
        assert res.acceptance_length == 29 / res.target_forwards
        useless = SpeculativeDecoder(target, OracleDrafter(full, False), LAYERS, steps, topk, ndt)
        res = useless.generate(p, 30)
        assert res.tokens == ref
        assert res.acceptance_length == 1.0 and res.target_forwards == 29
        assert res.slots.accepted == [0] * steps and res.slots.reached[0] == 29


def test_stops_at_eos(target):
    p = prompts(1, seed=5)[0]
    ref, _ = greedy_decode(target, p, 30)
    eos = ref[7]
    cut = ref[: ref.index(eos) + 1]
    plain, _ = greedy_decode(target, p, 30, eos_token_ids=[eos])
    assert plain == cut
    dec = SpeculativeDecoder(target, OracleDrafter(p + ref, True), LAYERS, 4, eos_token_ids=[eos])
    assert dec.generate(p, 30).tokens == cut


def test_tree_selection_and_argument_checks():
    # Scores: a(-0.1) > b(-0.5) > a.a(-0.6) > a.b(-1.2); keep 3 -> a, b, a.a with parents first.
    tree = select_tree([10, 11, 12, 13], [-1, -1, 0, 0], [1, 1, 2, 2], [-0.1, -0.5, -0.6, -1.2], 3)
    assert tree.tokens == [10, 11, 12] and tree.parents == [-1, -1, 0] and tree.depths == [1, 1, 2]
    with pytest.raises(ValueError, match="num_draft_tokens=8 must lie in 2..7"):
        check_tree_args(2, 2, 8)  # at most 1 + topk + (num_steps-1)*topk^2 = 7
    check_tree_args(2, 2, 7)
    with pytest.raises(ValueError, match="chain drafting"):
        check_tree_args(3, 1, 3)


# ----------------------------------------------------------------------------- SGLang's rank rule


class SlowTreeReference:
    """Tree drafting recomputed from scratch, without a cache or a tree mask: the draft
    output of a fed node is the last row of a plain causal forward over the committed rows
    followed by a `lane` of fed nodes ending with it. `rule="ancestors"`: the lane is the
    node's true ancestors (exact tree attention); `rule="rank"`: the nodes fed at the same
    frontier rank in the earlier steps (SGLang's KV slots per rank)."""

    def __init__(self, draft, rule: str):
        self.d, self.rule = draft, rule
        self.ids, self.aux = [], []

    def reset(self):
        self.ids, self.aux = [], []

    def commit(self, tokens, aux):
        self.ids += tokens
        self.aux.append(aux)

    def last_output(self, lane_tokens, lane_hidden):
        hidden = self.d.fuse(torch.cat(self.aux)[None])
        if lane_hidden:
            hidden = torch.cat([hidden, torch.stack(lane_hidden)[None]], dim=1)
        ids = self.ids + lane_tokens
        return self.d.step(torch.tensor([ids]), hidden, torch.arange(len(ids))[None], KVCache())[0, -1]

    def propose(self, num_steps, topk, num_draft_tokens):
        tokens, parents, depths, scores, hidden_in = [], [], [], [], []

        def expand(out, parent):  # the topk children of a node whose draft output is `out`
            top = torch.log_softmax(self.d.logits(out).double(), -1).topk(topk)
            for lp, tok in zip(top.values.tolist(), self.d.draft_to_target(top.indices).tolist()):
                tokens.append(tok), parents.append(parent), hidden_in.append(out)
                depths.append(1 if parent < 0 else depths[parent] + 1)
                scores.append(lp + (scores[parent] if parent >= 0 else 0.0))

        expand(self.last_output([], []), -1)
        frontier, lanes = list(range(topk)), [[] for _ in range(topk)]
        for _ in range(1, num_steps):
            outs = []
            for r, c in enumerate(frontier):
                if self.rule == "rank":
                    lanes[r].append(c)
                    lane = lanes[r]
                else:
                    lane, a = [], c
                    while a != -1:
                        lane.insert(0, a)
                        a = parents[a]
                outs.append(self.last_output([tokens[n] for n in lane], [hidden_in[n] for n in lane]))
            first_child = len(tokens)
            for c, out in zip(frontier, outs):
                expand(out, c)
            frontier = sorted(range(first_child, len(tokens)), key=lambda i: (-scores[i], i))[:topk]
        return select_tree(tokens, parents, depths, scores, num_draft_tokens - 1)


def draft_rounds(drafter, draft, num_steps, topk, ndt, rounds=6, seed=0):
    """Trees proposed over a few rounds of commits (random target states), as the decoder
    interleaves them: prefill-sized commit, then short ones."""
    g = torch.Generator().manual_seed(seed)
    width = draft.cfg.num_aux * draft.cfg.target_hidden_size
    drafter.reset()
    trees = []
    for k in range(rounds):
        n = 7 if k == 0 else 1 + k % 3
        drafter.commit(
            torch.randint(3, VOCAB, (n,), generator=g).tolist(), torch.randn(n, width, generator=g, dtype=torch.float64)
        )
        tree = drafter.propose(num_steps, topk, ndt)
        trees.append((tree.tokens, tree.parents, tree.depths))
    return trees


def most_tokens(steps, topk):
    return 1 + topk + (steps - 1) * topk * topk  # every candidate verified


@pytest.mark.parametrize("steps,topk,ndt", [(4, 2, 8), (3, 3, 10), (5, 2, most_tokens(5, 2)), (4, 3, 12)])
def test_sglang_mode_equals_slow_rank_rule_and_exact_mode_the_ancestor_rule(steps, topk, ndt):
    differs = 0
    for seed in range(3):
        draft = random_draft(tiny_draft_config(target_hidden_size=24), seed=seed)
        exact = draft_rounds(Eagle3Drafter(draft), draft, steps, topk, ndt, seed=seed)
        sglang = draft_rounds(Eagle3Drafter(draft, sglang_compatible=True), draft, steps, topk, ndt, seed=seed)
        assert sglang == draft_rounds(SlowTreeReference(draft, "rank"), draft, steps, topk, ndt, seed=seed)
        assert exact == draft_rounds(SlowTreeReference(draft, "ancestors"), draft, steps, topk, ndt, seed=seed)
        differs += sum(a != b for a, b in zip(exact, sglang))
    assert differs > 0  # depth >= 3 with topk > 1: the rank rule changes the drafts


@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 2), (4, 1, 5), (6, 1, 7), (1, 3, 4), (2, 2, 7), (2, 4, 12)])
def test_chains_and_two_step_trees_are_the_same_in_both_modes(steps, topk, ndt):
    draft = random_draft(tiny_draft_config(target_hidden_size=24), seed=steps + topk)
    exact = draft_rounds(Eagle3Drafter(draft), draft, steps, topk, ndt)
    assert draft_rounds(Eagle3Drafter(draft, sglang_compatible=True), draft, steps, topk, ndt) == exact


def test_sglang_mode_decodes_losslessly(target):
    draft = random_draft(tiny_draft_config(target_hidden_size=24), seed=4)
    exact = SpeculativeDecoder(target, Eagle3Drafter(draft), LAYERS, num_steps=4, topk=2, num_draft_tokens=8)
    sglang = SpeculativeDecoder(
        target, Eagle3Drafter(draft, sglang_compatible=True), LAYERS, num_steps=4, topk=2, num_draft_tokens=8
    )
    for p in prompts(2, seed=9):
        ref, _ = greedy_decode(target, p, 16)
        a, b = exact.generate(p, 16), sglang.generate(p, 16)
        assert a.tokens == ref and b.tokens == ref and b.gained == 15


def test_evaluate_decodes_with_the_mode_and_reports_both_figures(target, monkeypatch):
    import eagle3.families as families
    import workflows.evaluate as evaluate

    modes, real = [], families.Eagle3Drafter  # the EAGLE-3 family's drafter (eagle3.families)
    monkeypatch.setattr(
        families,
        "Eagle3Drafter",
        lambda d, sglang_compatible=False: (modes.append(sglang_compatible), real(d, sglang_compatible))[1],
    )
    draft = random_draft(tiny_draft_config(target_hidden_size=24), seed=4)
    p = prompts(1, seed=9)[0]
    ref, _ = greedy_decode(target, p, 12)
    rows = [{"id": "a", "input_ids": p + ref, "loss_mask": [0] * len(p) + [1] * len(ref)}]
    dec = evaluate.decode_all(target, draft, rows, LAYERS, 4, 2, 8, [], sglang_compatible=True)
    assert modes == [True] and dec["lossless"] and dec["per_row"][0]["gained"] == 11

    report = {
        "draft": "d",
        "target": "t",
        "prompts": 1,
        "max_new_tokens": 12,
        "num_steps": 4,
        "topk": 2,
        "acceptance_offline": 1.5,
        "acceptance_offline_per_position_average": 1.7,
        "acceptance_decoded": 1.6,
        "acceptance_decoded_sglang_definition": 1.8,
        "dtype": "float32",
        "serve_args": ["--x"],
        "parity_ratio": 0.94,
        "lossless": True,
        "text_agreement": 1.0,
        "tokens_per_s_plain": 10.0,
        "tokens_per_s_decoded": 12.0,
        "speedup_decoded": 1.2,
        "per_position_acceptance_offline": [0.5] * 4,
        "per_position_acceptance": [0.5] * 4,
        "sglang_draft_attention": {
            "acceptance_decoded": 1.25,
            "acceptance_decoded_sglang_definition": 1.375,
            "lossless": True,
            "per_position_acceptance": [0.4] * 4,
        },
    }
    md = evaluate.markdown(report, [])
    assert "| acceptance decoded (tokens per target pass) | 1.600 |" in md
    assert (
        "| acceptance decoded with SGLang's tree-draft attention (frontier-rank KV slots): tokens per pass / "
        "SGLang's definition / lossless | 1.250 / 1.375 / True |"
    ) in md


@pytest.mark.parametrize("topk, ndt", [(1, 4), (2, 6)], ids=["chain", "tree"])
def test_speculative_sampling_is_distributed_as_sampling_from_the_target(target, topk, ndt):
    """At temperature 0.2 (this random target is flat: its top token has 0.3 at 0.3) the
    decoder's first three tokens, over 600 seeded runs, follow the target's own sampling
    distribution (chi-square over the cells expected 5 times or more, the rest pooled); the
    drafts (the greedy continuation, with a wrong sibling first in the tree) are accepted
    often enough to matter."""
    from scipy.stats import chisquare

    temperature, runs, p = 0.2, 600, prompts(1, seed=5)[0]
    ref, _ = greedy_decode(target, p, 4)
    g = torch.Generator().manual_seed(0)
    dec = SpeculativeDecoder(
        target, OracleDrafter(p + ref, True), LAYERS, 3, topk, ndt, temperature=temperature, generator=g
    )
    counts, accepted = {}, 0
    for _ in range(runs):
        res = dec.generate(p, 3)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += res.accepted_uncut
    assert accepted > runs / 3, accepted  # speculation is exercised, not bypassed

    @torch.no_grad()
    def next_probs(prefix):
        return torch.softmax(target(torch.tensor([prefix])).logits[0, -1] / temperature, -1)

    def exact(seq):
        prob, prefix = 1.0, list(p)
        for t in seq:
            prob *= float(next_probs(prefix)[t])
            prefix.append(t)
        return prob

    expected = {seq: runs * exact(seq) for seq in counts}
    kept = [seq for seq, e in expected.items() if e >= 5]
    observed = [counts[s] for s in kept] + [runs - sum(counts[s] for s in kept)]
    wanted = [expected[s] for s in kept] + [runs - sum(expected[s] for s in kept)]
    assert len(kept) >= 5 and wanted[-1] >= 5
    assert chisquare(observed, wanted).pvalue > 1e-3, (observed, wanted)
