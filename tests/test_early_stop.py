"""The training loop's early stop (`LoopHooks.stop`, used by bench.bench_quality's patience):
it ends the run at the step it names, with the weights a full run has at that step, and
evaluating along the way changes nothing in training."""

import copy
import dataclasses

import pytest
import torch

from eagle3.modeling import Eagle3Draft
from eagle3.target_features import capture_batch
from eagle3.target_head import TargetHead
from eagle3.training import LoopConfig, OptimConfig, train_in_memory
from eagle3.ttt import NoiseConfig, TTTConfig
from eagle3.vocab import build_draft_vocab, count_tokens
from tests.helpers import tiny_draft_config, tiny_hf_llama

LAYERS = [0, 2, 4]


def setup():
    target = tiny_hf_llama(num_layers=6, hidden=24, vocab=97, dtype=torch.float32)
    texts = torch.randint(3, 97, (4, 16), generator=torch.Generator().manual_seed(1)).tolist()
    masks = [[0] * 5 + [1] * 11] * 4
    batches = [capture_batch(target, texts[i : i + 2], masks[i : i + 2], LAYERS, dtype=torch.float32) for i in (0, 2)]
    head = TargetHead(target.lm_head.weight.float())
    cfg = LoopConfig(
        steps=10,
        ttt=TTTConfig(length=3, noise=NoiseConfig(kind="gaussian", std=0.05)),  # noise: the RNG is in use
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        compute_dtype="float32",
        acceptance_k=2,
        eval_every=2,
        log_every=4,  # step 6 is logged only because the run stops there
    )
    return target, batches, head, cfg


def fresh_draft(target, batch) -> Eagle3Draft:
    torch.manual_seed(1)
    draft = Eagle3Draft(tiny_draft_config(hidden_size=24, head_dim=6, intermediate_size=48, draft_vocab_size=64))
    draft.load_target_embeddings(target.get_input_embeddings().weight.float())
    v = build_draft_vocab(count_tokens(batch["input_ids"], batch["loss_mask"], 97), 64, warn=lambda m: None)
    draft.set_vocab_mapping(v.d2t, v.t2d)
    return draft


def weights(draft) -> dict:
    return {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}


def test_a_stop_ends_the_run_at_its_step_with_the_full_runs_weights_there():
    target, batches, head, cfg = setup()
    runs = {}
    for name, stop_at, evaluated in (("stopped", 6, True), ("full", None, True), ("blind", None, False)):
        draft = fresh_draft(target, batches[0])
        seen: dict = {}

        def stop(done, state, draft=draft, seen=seen, stop_at=stop_at):
            seen[done] = weights(draft)
            assert state.best is not None and state.best["step"] <= done
            return done == stop_at

        history = train_in_memory(
            draft, head, batches, cfg, batches if evaluated else None, stop=stop if evaluated else None
        )
        runs[name] = (history, seen, weights(draft))

    history, seen, final = runs["stopped"]
    assert [r["step"] + 1 for r in history if "eval" in r] == [4, 6]  # logged evaluations, then the stop
    assert sorted(seen) == [2, 4, 6]
    full_history, full_seen, full_final = runs["full"]
    assert sorted(full_seen) == [2, 4, 6, 8]  # never asked at the last step: the run ends anyway
    assert [r["step"] + 1 for r in full_history if "eval" in r] == [4, 8, 10]
    for n in final:  # the stopped run's weights are the full run's at step 6 (same schedule)
        assert torch.equal(final[n], full_seen[6][n]), n
    blind_final = runs["blind"][2]
    for n in full_final:  # evaluations draw nothing from the training's RNG
        assert torch.equal(full_final[n], blind_final[n]), n
    assert any(not torch.equal(full_final[n], final[n]) for n in final)  # the stop really cut training


@pytest.mark.parametrize("dropout, ema_decay", [(0.0, 0.0), (0.2, 0.0), (0.0, 0.8)])
def test_a_run_resumed_from_its_checkpoint_hook_ends_as_the_uninterrupted_run(dropout, ema_decay):
    """`train_in_memory(checkpoint=)` hands over what a resume needs besides the weights;
    `resume=` of it, in a fresh draft with that step's weights, ends bit-equal to the run
    never interrupted (the optimizer's moments, the noise generator and the best kept);
    dropout's masks come from the same generator, so they resume too, and so does the
    weight average (the final draft, and every evaluation, are the average's)."""
    target, batches, head, cfg = setup()
    cfg = dataclasses.replace(cfg, checkpoint_every=2, dropout=dropout, ema_decay=ema_decay)
    draft = fresh_draft(target, batches[0])
    saved: dict = {}

    def checkpoint(done, best, last_eval, loop):  # the optimizer's state is live: a copy, as a file is
        saved[done] = (weights(draft), copy.deepcopy(loop))

    full = train_in_memory(draft, head, batches, cfg, batches, checkpoint=checkpoint)
    assert sorted(saved) == [2, 4, 6, 8, 10] and saved[4][1]["step"] == 4
    resumed = fresh_draft(target, batches[0])
    resumed.load_state_dict(saved[4][0], strict=False)
    rest = train_in_memory(resumed, head, batches, cfg, batches, resume=saved[4][1])
    for n, w in weights(draft).items():
        assert torch.equal(weights(resumed)[n], w), n
    assert rest[-1]["eval"] == full[-1]["eval"] and rest[0]["step"] + 1 == 8  # its first log: no step 1-4 rerun
    # Without the optimizer's state (a warm start), the same weights train elsewhere.
    warm = fresh_draft(target, batches[0])
    warm.load_state_dict(saved[4][0], strict=False)
    train_in_memory(
        warm,
        head,
        batches,
        cfg,
        batches,
        resume={**saved[4][1], "optimizer": {"state": {}, "param_groups": saved[4][1]["optimizer"]["param_groups"]}},
    )
    assert any(not torch.equal(weights(warm)[n], w) for n, w in weights(draft).items())


def test_the_prompt_fade_follows_the_loops_step_across_a_resume():
    """objective.tokens=fade over fade_until=0.1 of a 10-step run weighs the prompt 1 at
    step 0 and 0 from step 1: it ends bit-equal to one step on every token (on the same
    10-step horizon) resumed into nine on the answers only, and unlike either alone."""
    from eagle3.objectives import ObjectiveConfig

    target, batches, head, cfg = setup()
    horizon = dataclasses.replace(cfg.optim, horizon_steps=10)

    def run(objective, steps=10, resume=None, start_weights=None, checkpoint=None):
        draft = fresh_draft(target, batches[0])
        if start_weights is not None:
            draft.load_state_dict(start_weights, strict=False)
        loop = dataclasses.replace(cfg, steps=steps, optim=horizon, objective=objective, checkpoint_every=1)
        train_in_memory(draft, head, batches, loop, resume=resume, checkpoint=checkpoint)
        return weights(draft)

    faded = run(ObjectiveConfig(tokens="fade", fade_until=0.1))
    saved: dict = {}
    first = run(
        ObjectiveConfig(tokens="all"),
        steps=1,
        checkpoint=lambda done, best, last_eval, loop: saved.update(loop=copy.deepcopy(loop)),
    )
    pieced = run(ObjectiveConfig(tokens="answer"), resume=saved["loop"], start_weights=first)
    for n, w in faded.items():
        assert torch.equal(pieced[n], w), n
    for fixed in ("all", "answer"):
        other = run(ObjectiveConfig(tokens=fixed))
        assert any(not torch.equal(other[n], w) for n, w in faded.items()), fixed
