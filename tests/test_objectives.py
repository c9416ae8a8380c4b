"""Objectives of a TTT step (eagle3.objectives) against slow, obvious references; their
averaging in score_steps; the cosine horizon; the feature norms before fc."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.objectives import ObjectiveConfig, acceptance_rate, position_loss
from eagle3.schema import ConfigError
from eagle3.training import OptimConfig, lr_at
from eagle3.ttt import score_steps, step_weights
from tests.helpers import LogitDraft, random_draft, tiny_draft_config


def slow_acceptance(p: list[float], q: list[float]) -> float:
    return sum(min(a, b) for a, b in zip(p, q))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(0, 10_000))
def test_acceptance_and_losses_match_slow_references(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=g, dtype=torch.float64) * 3
    p = torch.softmax(torch.randn(3, vocab, generator=g, dtype=torch.float64) * 3, -1)
    log_q = torch.log_softmax(logits, -1)
    q = log_q.exp()
    alpha = acceptance_rate(log_q, p)
    for i in range(3):
        a = slow_acceptance(p[i].tolist(), q[i].tolist())
        assert alpha[i].item() == pytest.approx(a, abs=1e-12)
        kl = sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p[i].tolist(), q[i].tolist()))
        ce = -sum(pv * math.log(qv) for pv, qv in zip(p[i].tolist(), q[i].tolist()))
        assert position_loss("soft_ce", log_q, p)[0][i].item() == pytest.approx(ce, rel=1e-10)
        assert position_loss("log_acceptance", log_q, p)[0][i].item() == pytest.approx(-math.log(a), rel=1e-10)
        assert position_loss("kl_acceptance", log_q, p)[0][i].item() == pytest.approx((1 - a) * kl + 1 - a, rel=1e-9)
    # Identical distributions are accepted with certainty.
    assert torch.allclose(acceptance_rate(torch.log(p), p), torch.ones(3, dtype=torch.float64))


def test_kl_acceptance_weight_carries_no_gradient():
    """d/dlogits of w*KL + (1-a) with w = 1-a held constant: (1-a) dKL + d(1-a)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(5, 7, generator=g, dtype=torch.float64), -1)
    loss, alpha = position_loss("kl_acceptance", torch.log_softmax(logits, -1), p)
    (got,) = torch.autograd.grad(loss.sum(), logits)
    log_q = torch.log_softmax(logits, -1)
    kl = (p * (torch.log(p) - log_q)).sum(-1)
    a = acceptance_rate(log_q, p)
    (d_kl,) = torch.autograd.grad(kl, logits, grad_outputs=(1 - alpha.detach()), retain_graph=True)
    (d_a,) = torch.autograd.grad((1 - a).sum(), logits)
    assert torch.allclose(got, d_kl + d_a)


@pytest.mark.parametrize("kind", ["log_acceptance", "kl_acceptance", "soft_ce"])
def test_each_objective_drives_acceptance_up(kind):
    """Minimising each objective over free logits raises sum min(p, q) close to 1."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 16, generator=g) * 2, -1)
    logits = torch.zeros(4, 16, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    start = acceptance_rate(torch.log_softmax(logits, -1), p).mean().item()
    for _ in range(300):
        loss, _ = position_loss(kind, torch.log_softmax(logits, -1), p)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    end = acceptance_rate(torch.log_softmax(logits, -1), p).mean().item()
    assert start < 0.7 and end > 0.97, (kind, start, end)


def test_score_steps_normalisation_and_unreachable_positions():
    h0 = torch.log(torch.tensor([[[1.0, 1.0], [1.0, 3.0], [2.0, 1.0], [1.0, 1.0]]]))
    probs = torch.tensor([[[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]]])
    # Row 0's label (read at t=1) is target id 10 (in the draft vocab), row 1's (t=2) is 3: unreachable.
    argmax = torch.tensor([[0, 10, 3, 10]])
    w = step_weights(torch.tensor([[0, 1, 1, 1]]), torch.ones(1, 4), 1)
    ce0 = -(0.2 * math.log(0.5) + 0.8 * math.log(0.5))
    ce1 = -(0.6 * math.log(0.25) + 0.4 * math.log(0.75))
    plain = score_steps(LogitDraft(), [h0], probs, argmax, w, 0.8)
    assert plain.step_loss[0] == pytest.approx((ce0 + ce1) / 2, rel=1e-6)
    per_token = score_steps(
        LogitDraft(),
        [h0],
        probs,
        argmax,
        w,
        0.8,
        ObjectiveConfig(normalise="positions"),
        real_positions=torch.tensor(4),
    )
    assert per_token.step_loss[0] == pytest.approx((ce0 + ce1) / 4, rel=1e-6)
    skip = score_steps(LogitDraft(), [h0], probs, argmax, w, 0.8, ObjectiveConfig(skip_unreachable=True))
    assert skip.step_loss[0] == pytest.approx(ce0, rel=1e-6)
    # Accuracy still counts the unreachable row, as a miss: row 0 hits (draft 0 -> 10), row 1 cannot.
    assert skip.step_acc == plain.step_acc == [0.5]
    # Acceptance rate per step: mean of sum min(p, q) over the scored rows.
    a0 = min(0.2, 0.5) + min(0.8, 0.5)
    a1 = min(0.6, 0.25) + min(0.4, 0.75)
    assert plain.step_alpha[0] == pytest.approx((a0 + a1) / 2, rel=1e-6)


def test_objective_config_refuses_unknown_kinds():
    with pytest.raises(ConfigError, match="objective.kind='mse' is not one of"):
        ObjectiveConfig(kind="mse").validate()
    with pytest.raises(ConfigError, match="normalise='tokens'"):
        ObjectiveConfig(normalise="tokens").validate()
    with pytest.raises(ConfigError, match="objective.tokens='prompt' is not 'answer', 'all' or 'fade'"):
        ObjectiveConfig(tokens="prompt").validate()
    with pytest.raises(ConfigError, match="fade_until"):
        ObjectiveConfig(tokens="fade", fade_until=0).validate()


def prompt_and_answer_batch():
    """A random draft, head and two-row batch: row 0 a 7-token prompt and 5-token answer,
    row 1 a 5-token prompt and 4-token answer, then padding."""
    from eagle3.target_head import TargetHead

    torch.manual_seed(0)
    draft = random_draft(tiny_draft_config(), dtype=torch.float32)
    head = TargetHead(torch.randn(97, 24))
    t = 12
    batch = {
        "input_ids": torch.randint(0, 97, (2, t)),
        "aux": torch.randn(2, t, 72),
        "final": torch.randn(2, t, 24),
        "attention_mask": torch.ones(2, t, dtype=torch.long),
        "loss_mask": torch.zeros(2, t, dtype=torch.long),
    }
    batch["attention_mask"][1, 9:] = 0  # row 1 is padded after 9 tokens
    batch["loss_mask"][0, 7:] = 1
    batch["loss_mask"][1, 5:9] = 1
    return draft, head, batch


def test_training_on_all_tokens_scores_the_prompt_in_training_only():
    """objective.tokens=all: training scores every row whose label is a real token of the
    sample (prompt included); evaluation keeps scoring the answers (the loss mask)."""
    from eagle3.training import forward_batch
    from eagle3.ttt import NoiseConfig, TTTConfig

    draft, head, batch = prompt_and_answer_batch()
    t = batch["input_ids"].shape[1]
    ttt = TTTConfig(length=3, noise=NoiseConfig(kind="none"))
    assert ObjectiveConfig().tokens == "all"  # the default (docs/results.md: ablations)
    answer = forward_batch(draft, head, batch, ttt, train=True, objective=ObjectiveConfig(tokens="answer"))
    every = forward_batch(draft, head, batch, ttt, train=True, objective=ObjectiveConfig(tokens="all"))
    held = forward_batch(draft, head, batch, ttt, train=False, objective=ObjectiveConfig(tokens="all"))
    assert torch.equal(answer.weights, step_weights(batch["loss_mask"], batch["attention_mask"], 3))
    assert torch.equal(held.weights, answer.weights)
    # By hand: row t, step j is scored when its label x_{t+2+j} is a real token.
    want = torch.zeros(2, t, 3)
    for b, n in ((0, 12), (1, 9)):
        for j in range(3):
            want[b, : max(0, n - 2 - j), j] = 1
    assert torch.equal(every.weights, want)


def test_the_prompt_fade_weighs_the_prompt_down_to_answers_only():
    """objective.tokens=fade: the prompt's rows weigh 1 at step 0, linearly less to 0 at
    fade_until of the horizon, 0 after; the answers' rows weigh 1 throughout. Checked
    against the two fixed masks: weights = answer + w * (all - answer), and the loss is the
    same blend of the two per-step losses' numerators."""
    from eagle3.training import forward_batch
    from eagle3.ttt import NoiseConfig, TTTConfig

    fade = ObjectiveConfig(tokens="fade", fade_until=0.5)
    fade.validate()
    assert [fade.prompt_weight(s, 100) for s in (0, 10, 25, 49, 50, 80)] == pytest.approx([1, 0.8, 0.5, 0.02, 0, 0])
    assert ObjectiveConfig(tokens="all").prompt_weight(99, 100) == 1.0
    assert ObjectiveConfig(tokens="answer").prompt_weight(0, 100) == 0.0

    draft, head, batch = prompt_and_answer_batch()
    ttt = TTTConfig(length=2, noise=NoiseConfig(kind="none"), decay=1.0)

    def scores(objective, weight=None):
        return forward_batch(draft, head, batch, ttt, train=True, objective=objective, prompt_weight=weight)

    answer, every = scores(ObjectiveConfig(tokens="answer")), scores(ObjectiveConfig(tokens="all"))
    assert torch.equal(scores(fade).weights, every.weights)  # no step given: the run's first
    assert torch.equal(scores(fade, 1.0).weights, every.weights)
    assert torch.equal(scores(fade, 0.0).weights, answer.weights)
    half = scores(fade, 0.3)
    assert torch.allclose(half.weights, answer.weights + 0.3 * (every.weights - answer.weights))
    # Per step j the loss is sum(w * l) / sum(w): with n_a answer rows of n_all in all,
    # the fade's numerator is n_a * L_answer + 0.3 * (n_all * L_all - n_a * L_answer).
    n_a, n_all = answer.weights.sum((0, 1)), every.weights.sum((0, 1))
    la, le = answer.step_loss_t, every.step_loss_t
    want = (n_a * la + 0.3 * (n_all * le - n_a * la)) / (n_a + 0.3 * (n_all - n_a))
    assert torch.allclose(half.step_loss_t, want, rtol=1e-5)
    assert half.loss.item() == pytest.approx(float(want.sum()), rel=1e-5)


def test_horizon_keeps_the_long_runs_learning_rates():
    """A 1107-step run on a 3690-step horizon follows the 3690-step run's schedule exactly."""
    long = OptimConfig(lr=1e-3, warmup_steps=55, min_lr_ratio=0.0)
    short = OptimConfig(lr=1e-3, warmup_steps=55, min_lr_ratio=0.0, horizon_steps=3690)
    assert [lr_at(s, 1107, short) for s in range(1107)] == [lr_at(s, 3690, long) for s in range(1107)]
    assert lr_at(1106, 1107, short) > 0.7e-3  # not the end of a cosine
    assert lr_at(1106, 1107, long) < 1e-5


# --- feature norms before fc (SGLang's fc_norm / norm_before_fc) ------------------------------
def rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("flags", [{"fc_norm": True}, {"norm_before_fc": True}])
def test_feature_norms_match_their_definition(flags):
    cfg = tiny_draft_config(**flags)
    draft = random_draft(cfg)
    names = set(draft.state_dict())
    if flags.get("fc_norm"):
        assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names
        assert "input_norm.weight" not in names
    else:
        assert "input_norm.weight" in names and not any(n.startswith("fc_norm") for n in names)
    aux = torch.randn(2, 5, 3 * 24, dtype=torch.float64) * torch.tensor(
        [0.1, 10.0, 1000.0], dtype=torch.float64
    ).repeat_interleave(24)
    eps = cfg.rms_norm_eps
    if flags.get("fc_norm"):
        parts = aux.chunk(3, -1)
        want = torch.cat([rms(x, draft.fc_norm[i].weight, eps) for i, x in enumerate(parts)], -1)
    else:
        want = rms(aux, draft.input_norm.weight, eps)
    assert torch.allclose(draft.fuse(aux), draft.fc(want))
    plain = set(random_draft(tiny_draft_config()).state_dict())
    assert not any(n.startswith(("fc_norm", "input_norm")) for n in plain)


def test_fc_norm_makes_fc_scale_free_per_layer():
    """With fc_norm, scaling one captured layer's state by 1000 changes nothing."""
    draft = random_draft(tiny_draft_config(fc_norm=True))
    aux = torch.randn(1, 4, 72, dtype=torch.float64)
    loud = aux.clone()
    loud[..., 48:] *= 1000
    assert torch.allclose(draft.fuse(aux), draft.fuse(loud), rtol=1e-4, atol=1e-4)  # up to the eps of the norm


def test_specforge_scored_rows_differ_from_ours_at_the_answer_ends():
    loss_mask, attn = torch.tensor([[0, 0, 1, 1, 1, 0, 0]]), torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    ours = step_weights(loss_mask, attn, 2)
    theirs = step_weights(loss_mask, attn, 2, rows="input")
    # Ours: the predicted token x_{t+2+j} is trained. SpecForge's: the row's own x_{t+j} is,
    # and the label position t+1+j is a real token of the sample.
    assert ours[0, :, 0].tolist() == [1, 1, 1, 0, 0, 0, 0] and ours[0, :, 1].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert theirs[0, :, 0].tolist() == [0, 0, 1, 1, 1, 0, 0] and theirs[0, :, 1].tolist() == [0, 1, 1, 1, 0, 0, 0]


# --- the head's start (draft.init_head) --------------------------------------------------------
def test_init_head_from_target_starts_at_the_targets_own_distribution():
    """With the target's head rows and final norm, the draft's logits of any hidden state are
    the target head's logits over the draft vocabulary: same values, same argmax."""
    cfg = tiny_draft_config(hidden_size=24)  # as wide as the target, as every real draft is
    draft = random_draft(cfg)
    g = torch.Generator().manual_seed(3)
    chosen = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab_mapping(chosen - torch.arange(cfg.draft_vocab_size), t2d)
    head = torch.randn(cfg.vocab_size, 24, generator=g, dtype=torch.float64)
    norm = 1 + 0.3 * torch.randn(24, generator=g, dtype=torch.float64)
    draft.init_head_from_target(head, norm)
    hidden = torch.randn(2, 5, 24, generator=g, dtype=torch.float64) * 4
    want = rms(hidden, norm, cfg.rms_norm_eps) @ head[chosen].T  # the slow reference, row by row
    assert torch.allclose(draft.logits(hidden), want)
    full = rms(hidden, norm, cfg.rms_norm_eps) @ head.T
    full[..., ~t2d] = -torch.inf  # the target's best token among those the draft has
    assert torch.equal(draft.draft_to_target(draft.logits(hidden).argmax(-1)), full.argmax(-1))


def test_init_head_refuses_a_draft_narrower_than_the_target():
    draft = random_draft(tiny_draft_config())  # hidden 32, target head 24 wide
    with pytest.raises(ValueError, match=r"draft.init_head=target .* hidden_size must equal the target's"):
        draft.init_head_from_target(torch.randn(97, 24), torch.ones(24))


def test_draft_section_refuses_an_unknown_head_start():
    from workflows.core.config import DraftSection

    with pytest.raises(ConfigError, match=r"draft.init_head='tied' is not 'random' or 'target'"):
        DraftSection(init_head="tied").validate()


# --- the draft's RoPE base (draft.rope_theta) ------------------------------------------------
def test_draft_rope_theta_is_the_targets_unless_set_and_moves_the_attention():
    from eagle3.attention import make_ttt_attention
    from eagle3.vocab import build_draft_vocab
    from workflows.core.config import compose

    cfg = compose(["+experiment=specforge_smollm2"])  # a preset's spec: no checkpoint needed
    vocab = build_draft_vocab(torch.ones(cfg.target.vocab_size), 256)
    assert cfg.draft.rope_theta is None
    assert cfg.draft.build(cfg.target, vocab).rope_theta == cfg.target.rope_theta == 100000.0
    own = compose(["+experiment=specforge_smollm2", "draft.rope_theta=10000"])
    assert own.draft.build(cfg.target, vocab).rope_theta == 10000.0
    with pytest.raises(ConfigError, match=r"draft.rope_theta=-1.0 is out of range: it must be > 0"):
        compose(["draft.rope_theta=-1"])
    # The base reaches the attention: same weights, another base, other outputs (and the
    # same outputs at position 0, where every rotation is the identity).
    a, b = (random_draft(tiny_draft_config(rope_theta=theta)) for theta in (10000.0, 100.0))
    emb, hidden = torch.randint(0, 97, (1, 6)), torch.randn(1, 6, 32, dtype=torch.float64)
    pos = torch.arange(6)[None]
    segments = torch.zeros(1, 6, dtype=torch.long)
    out_a = a.step(emb, hidden, pos, make_ttt_attention(segments, "dense"))
    out_b = b.step(emb, hidden, pos, make_ttt_attention(segments, "dense"))
    torch.testing.assert_close(out_a[:, 0], out_b[:, 0])
    assert (out_a[:, 1:] - out_b[:, 1:]).abs().max() > 1e-3


def test_heldout_accuracy_per_sample_on_specforge_rows_matches_a_sample_by_sample_reference():
    """evaluate_heldout's SpecForge figure: per sample, hits / scored rows on SpecForge's rows,
    then the mean over samples; padded batches of several samples give what each sample alone does."""
    from eagle3.target_features import collate_samples
    from eagle3.target_head import TargetHead
    from eagle3.training import LoopConfig, forward_batch
    from eagle3.ttt import NoiseConfig, TTTConfig
    from workflows.train.evaluation import evaluate_heldout

    cfg = tiny_draft_config()
    draft = random_draft(cfg)
    g = torch.Generator().manual_seed(5)
    # Target and draft both choose mostly between tokens 0 and 1, so about half the rows hit.
    weight = torch.randn(cfg.vocab_size, 24, generator=g, dtype=torch.float64) * 0.01
    weight[:2] = torch.randn(2, 24, generator=g, dtype=torch.float64) * 5
    head = TargetHead(weight)
    with torch.no_grad():
        draft.lm_head.weight[2:] *= 0.01
        draft.lm_head.weight[:2] *= 50
    samples = []
    for n, start in ((9, 3), (14, 5), (6, 2), (11, 4), (8, 7)):
        mask = torch.zeros(n, dtype=torch.long)
        mask[start:] = 1
        samples.append(
            {
                "input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g),
                "loss_mask": mask,
                "aux": torch.randn(n, 72, generator=g, dtype=torch.float64) * 3,
                "final": torch.randn(n, 24, generator=g, dtype=torch.float64) * 3,
            }
        )
    loop = LoopConfig(
        steps=1, ttt=TTTConfig(length=3, noise=NoiseConfig(kind="none")), acceptance_k=2, compute_dtype="float32"
    )
    batches = [collate_samples(samples[:3]), collate_samples(samples[3:])]
    got = evaluate_heldout(draft, head, batches, loop, edges=[4], device=torch.device("cpu"))

    rates, hits, counts = [], torch.zeros(3), torch.zeros(3)
    with torch.no_grad():
        for s in samples:
            b = collate_samples([s])
            scores = forward_batch(draft, head, b, loop.ttt, train=False)
            w = step_weights(b["loss_mask"], b["attention_mask"], 3, rows="input")[0]  # [T, L]
            h = (scores.correct[0].double() * w).sum(0)
            rates.append([float(h[j] / w[:, j].sum()) if w[:, j].sum() > 0 else None for j in range(3)])
            hits, counts = hits + h, counts + w.sum(0)
    for j in range(3):
        per_sample = [r[j] for r in rates if r[j] is not None]
        assert got["step_acc_specforge_per_sample"][j] == pytest.approx(sum(per_sample) / len(per_sample), abs=1e-12)
        assert got["step_acc_specforge_rows"][j] == pytest.approx(float(hits[j] / counts[j]), abs=1e-12)
    # The two views differ when samples differ in length (else this test could not tell them apart).
    assert got["step_acc_specforge_per_sample"] != pytest.approx(got["step_acc_specforge_rows"], abs=1e-9)


def test_build_draft_starts_the_head_from_the_tiny_targets_checkpoint(tiny_target):
    """draft.init_head=target through the train stage's builder, read from the prepared
    checkpoint's safetensors: the draft's rows are the target's rows of its draft ids."""
    common = ["target=tiny", f"cache_dir={tiny_target.parent.parent}", "draft.draft_vocab_size=64"]
    draft, _ = built_draft(tiny_target, [*common, "draft.init_head=target"])
    head, norm = target_head_and_norm(tiny_target)
    assert torch.equal(draft.lm_head.weight, head[draft.target_ids()])
    assert torch.equal(draft.norm.weight, norm)
    plain, _ = built_draft(tiny_target, common)  # the default: torch's random start
    assert not torch.equal(plain.lm_head.weight, draft.lm_head.weight)
    assert torch.equal(plain.norm.weight, torch.ones_like(plain.norm.weight))


def test_a_block_draft_with_the_targets_head_keeps_it_frozen(tiny_target):
    """draft.dflash.head=target: the block draft's lm_head is the target's rows of its draft
    ids and takes no gradient (nor an optimizer slot); its final norm starts at the target's
    and trains. The default block draft trains its own head from a random start."""
    from eagle3.training import make_optimizer
    from workflows.core.config import compose

    common = ["target=tiny", f"cache_dir={tiny_target.parent.parent}", "draft=dflash", "draft.draft_vocab_size=64"]
    draft, cfg = built_draft(tiny_target, [*common, "draft.dflash.head=target"])
    head, norm = target_head_and_norm(tiny_target)
    assert torch.equal(draft.lm_head.weight, head[draft.target_ids()])
    assert torch.equal(draft.norm.weight, norm)
    assert not draft.lm_head.weight.requires_grad and draft.norm.weight.requires_grad
    optimised = {id(p) for group in make_optimizer(draft, cfg.train.optim).param_groups for p in group["params"]}
    assert id(draft.lm_head.weight) not in optimised and id(draft.norm.weight) in optimised
    draft.logits(torch.randn(2, 3, draft.cfg.hidden_size)).logsumexp(-1).sum().backward()
    assert draft.lm_head.weight.grad is None and draft.norm.weight.grad.abs().sum() > 0

    plain, _ = built_draft(tiny_target, common)
    assert plain.lm_head.weight.requires_grad and not torch.equal(plain.lm_head.weight, draft.lm_head.weight)
    with pytest.raises(ConfigError, match=r"draft.dflash.head='tied' is not one of \['trained', 'target'\]"):
        compose([*common, "draft.dflash.head=tied"])


def built_draft(tiny_target, overrides: list[str]):
    """(the train stage's draft for `overrides`, their config), over a fixed 64-id vocabulary."""
    from eagle3.vocab import build_draft_vocab
    from workflows.core.config import compose
    from workflows.train.trainer import build_draft

    counts = torch.arange(1024, 0, -1)[torch.randperm(1024, generator=torch.Generator().manual_seed(0))]
    vocab = build_draft_vocab(counts, 64, warn=lambda *_: None)
    cfg = compose(overrides)
    return build_draft(cfg.draft, cfg.target, str(tiny_target), vocab, seed=cfg.seed), cfg


def target_head_and_norm(tiny_target) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepared tiny target's lm_head (its embeddings where tied) and final norm, float32."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(tiny_target.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    return head, weights["model.norm.weight"].float()
