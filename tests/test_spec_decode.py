"""The reference speculative decoder is lossless and counts acceptance right."""
import pytest
import torch

from eagle3.spec_decode import (DraftTree, Eagle3Drafter, SpeculativeDecoder, check_tree_args, greedy_decode,
                                select_tree)
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
            for tok in ([bad, good] if topk > 1 else [good if self.right else bad]):
                if len(tree) == num_draft_tokens - 1:
                    return tree
                tree.tokens.append(tok if self.right or tok == bad else (good + 2) % VOCAB)
                tree.parents.append(parent)
                tree.depths.append(depth)
            parent = len(tree) - 1
        return tree


def prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def target():
    return tiny_hf_llama(num_layers=6, hidden=24, vocab=VOCAB, dtype=torch.float64)


def test_plain_greedy_matches_hf_generate(target):
    for p in prompts(4):
        ours, _ = greedy_decode(target, p, 20)
        hf = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert ours == hf


@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 2), (3, 1, 4), (5, 1, 6), (3, 2, 6), (2, 3, 8), (4, 4, 12)])
def test_eagle3_draft_decoding_is_lossless(target, steps, topk, ndt):
    draft = random_draft(tiny_draft_config(target_hidden_size=24), seed=steps + topk)
    dec = SpeculativeDecoder(target, Eagle3Drafter(draft), LAYERS, num_steps=steps, topk=topk, num_draft_tokens=ndt)
    forwards = 0
    for p in prompts(10, seed=steps * 10 + topk):
        ref, _ = greedy_decode(target, p, 25)
        res = dec.generate(p, 25)
        assert res.tokens == ref, (p, steps, topk)
        assert res.gained == 24  # every token after the prefill's came from a verify pass
        assert 1 <= res.acceptance_length <= steps + 1
        forwards += res.target_forwards
    assert forwards > 0


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
