"""The training step and the one training loop, over batches from anywhere.

`train_step` is the unit of training, the one step every backend runs (the plain optimizer
or the DeepSpeed engine, the benchmarks); `fit` is the one loop around it (the schedule,
and when to evaluate, log and checkpoint), run by the train stage's Trainer for the store
and for online states, and by `train_in_memory` for a list of batches. A batch is a dict
of tensors:

    input_ids [B, T] int64      loss_mask [B, T]      attention_mask [B, T] (right padding)
    aux [B, T, n*H_t]           final [B, T, H_t]     (target states, see storage/)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

import torch

from eagle3.families import family_of
from eagle3.metrics import acceptance
from eagle3.modeling import Eagle3Draft
from eagle3.objectives import ObjectiveConfig
from eagle3.schema import NOT_OUTPUT, ConfigError, check_ranges
from eagle3.sequence_parallel import SequenceParallel, target_window
from eagle3.target_head import TargetHead
from eagle3.ttt import StepScores, TTTConfig, add_noise, shift_left, step_weights
from eagle3.weight_average import WeightAverage


@dataclass
class OptimConfig:
    lr: float = 1e-3  # SpecForge's single-GPU setting; short runs (the embedded default) need it
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    warmup_steps: int = 10  # linear warmup from 0, then the cosine
    min_lr_ratio: float = 0.1  # where the cosine ends, as a fraction of lr
    grad_clip: float = 0.5  # the gradients' global norm is clipped to this
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (beta1, beta2)
    # The cosine's length in steps (null: train.steps). A run stopped early (train.stop_after)
    # on a longer horizon keeps the learning rates of the longer run.
    horizon_steps: int | None = None

    def validate(self, where: str = "optim") -> None:
        # grad_clip <= 0 would zero every gradient; betas outside [0, 1) diverge.
        check_ranges(
            self,
            where,
            lr=">0",
            weight_decay=">=0",
            warmup_steps=">=0",
            min_lr_ratio="[0,1]",
            grad_clip=">0",
            betas="[0,1)",
            horizon_steps=">=1",
        )
        if len(self.betas) != 2:
            raise ConfigError(f"{where}.betas must have two values, got {self.betas}")


@dataclass
class LoopConfig:
    steps: int  # the caller's budget (the pipeline's default lives with its schema, workflows.core.config)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # bf16 autocast: on GPUs and AMX CPUs the matmuls run several times faster, on CPUs
    # without bf16 units many times slower (bench/bench_train_step.py); fp32 is exact.
    compute_dtype: Literal["bfloat16", "float32"] = "float32"
    # Recompute the draft's MLP in backward instead of keeping its [T, intermediate]
    # activations (three per TTT step: 0.7 GiB a step at T 8192 and Llama-3.1-8B's 14336),
    # for one more MLP forward; "none" keeps them (the faster choice where memory allows).
    # The same arithmetic either way, so it is not part of what the train stage produced.
    activation_checkpointing: Literal["none", "mlp"] = field(default="none", metadata=NOT_OUTPUT)
    # Residual dropout in the draft layer (its attention's and MLP's outputs), training only:
    # a regulariser against the overfit of many epochs over few samples (issue 26).
    dropout: float = 0.0
    # Evaluate, choose the best walk by and save the exponential moving average of the
    # weights, with this decay (eagle3.weight_average; 0: the weights of the last step).
    # Training steps the raw weights either way.
    ema_decay: float = 0.0
    acceptance_k: int = 4  # draft tokens per target pass in the simulated acceptance
    log_every: int = field(default=25, metadata=NOT_OUTPUT)  # steps between progress lines and metrics records
    eval_every: int = 100  # held-out evaluation, steps (and at the end, and at each checkpoint)
    checkpoint_every: int = 100  # steps; 0 = only at the end
    seed: int = 0  # train_in_memory's seed (tests, benchmarks); the train stage uses the top-level seed

    def validate(self, where: str = "train") -> None:
        self.ttt.validate(f"{where}.ttt")
        self.objective.validate(f"{where}.objective")
        self.optim.validate(f"{where}.optim")
        check_ranges(
            self,
            where,
            steps=">=1",
            dropout="[0,1)",
            ema_decay="[0,1)",
            acceptance_k=">=1",
            log_every=">=1",
            eval_every=">=1",
            checkpoint_every=">=0",
        )
        if self.activation_checkpointing not in ("none", "mlp"):
            raise ConfigError(
                f"{where}.activation_checkpointing={self.activation_checkpointing!r} is not one of ['none', 'mlp']"
            )


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr` over `horizon_steps` (or `total`)."""
    total = cfg.horizon_steps or total
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(draft: Eagle3Draft, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in draft.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), fused=fused_adamw(params)
    )


def fused_adamw(params: list[torch.Tensor]) -> bool:
    """AdamW's fused kernel where the draft lives on a GPU: one launch for all parameters
    instead of a few per tensor (the optimizer step of a 1B-parameter draft is otherwise
    launch-bound). The CPU keeps the default implementation, whose numbers the tests and
    the DeepSpeed comparison were measured with."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def forward_batch(
    draft,
    head: TargetHead,
    batch: dict,
    ttt: TTTConfig,
    train: bool,
    generator=None,
    objective: ObjectiveConfig | None = None,
    prompt_weight: float | None = None,
    steps: int | None = None,
    sp: SequenceParallel | None = None,
):
    """Score one batch with the draft's family's pass (eagle3.families: the TTT unroll, or
    blocks); returns StepScores (loss differentiable when train).

    `steps`: draft tokens scored per row (None: what the family trains, TTT steps or block
    slots; the evaluate stage passes its k, so a block draft drafts blocks of k + 1 there,
    as it will be served). In training the prompt's positions weigh `prompt_weight` against
    the answers' 1 (None: the objective's weight at the run's first step,
    `ObjectiveConfig.prompt_weight`).

    Packed batches (eagle3.target_features.pack_samples) also carry `position_ids` and
    `segment_ids` [B, T]; a batch without them is one sample per row.

    `sp` (eagle3.sequence_parallel): the batch is the whole group's, and this rank scores
    its rows only: the noise and the step weights are drawn and derived on the whole
    sequence (the same values as on one rank), then cut; the target's head runs on the
    window of states those rows read. Each figure is this rank's share (eagle3.ttt.score_steps)."""
    if "aux_scale" in batch:  # int8 states as an int8 store holds them
        raise ValueError("forward_batch got int8 states with their scales: dequantise the batch first (data.to_device)")
    family = family_of(draft)
    aux = batch["aux"]
    if train:
        aux = add_noise(aux, ttt.noise, generator)
    length = steps or family.trained_steps(draft.cfg, ttt)
    objective = objective or ObjectiveConfig()
    # The prompt's positions count in training only, as much as ObjectiveConfig.tokens says.
    weight = 0.0 if not train else objective.prompt_weight(0, 1) if prompt_weight is None else prompt_weight
    weights = scored_steps(batch, length, weight)
    if sp is None:
        probs, best = head(batch["final"], draft.target_ids())
        return family.score(draft, probs, best, weights, batch, aux, ttt, objective, train, generator)
    if not family.sequence_parallel:
        raise ConfigError(
            f"train.sequence_parallel={sp.size}: the {family.name} draft has no sequence-parallel pass "
            "(its block attention is its own); EAGLE-3 only, or train.sequence_parallel=1"
        )
    probs, best = head(target_window(batch["final"], sp, length), draft.target_ids())
    return family.score(draft, probs, best, sp.local(weights), batch, aux, ttt, objective, train, generator, sp=sp)


def scored_steps(batch: dict, length: int, prompt_weight: float) -> torch.Tensor:
    """[B, T, length] weights of the scored steps (eagle3.ttt.step_weights): the answers'
    at 1, the prompt's at `prompt_weight`."""
    segments, attn = batch.get("segment_ids"), batch["attention_mask"]
    scored = attn if prompt_weight == 1 else batch["loss_mask"]
    weights = step_weights(scored, attn, length, segment_ids=segments)
    if 0 < prompt_weight < 1:  # the answers' rows at 1, the prompt's at `prompt_weight`
        every = step_weights(attn, attn, length, segment_ids=segments)
        weights = weights + prompt_weight * (every - weights)
    return weights


@torch.no_grad()
def acceptance_rates_at(draft, head, batch: dict, length: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft step j (a TTT step, a block's slot), the summed chance that a sampling
    verifier at `temperature` accepts the draft's own guess, and the count of scored
    positions -> ([L], [L]).

    SGLang and vLLM draft deterministically (the draft's top tokens), and a deterministic
    guess y is accepted with the target's probability of y at the serving temperature
    (eagle3.spec_decode.SpeculativeDecoder); here y is step j's argmax at row t, scored
    against the target at t+1+j, over the rows the evaluation scores (the answers)."""
    s = forward_batch(draft, head, batch, TTTConfig(length=length), train=False, steps=length)
    sums, counts = [], []
    for j in range(length):
        p = head.token_probs(shift_left(batch["final"], 1 + j), s.guesses[..., j], temperature)
        w = s.weights[..., j]
        sums.append((p * w).sum()), counts.append(w.sum())
    return torch.stack(sums), torch.stack(counts)


def autocast_for(dtype: str, device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


class PlainOptimizer:
    """The optimizer side of a step in this process: torch AdamW, micro-batches accumulated
    by scaling each loss, clipping at `grad_clip`. The DeepSpeed engine
    (workflows.train.trainer.DeepSpeedStep) offers the same calls."""

    def __init__(self, module: torch.nn.Module, cfg: OptimConfig):
        self.module = module
        self.optimizer = make_optimizer(module, cfg)
        self.clip = cfg.grad_clip

    def begin(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.module.train()
        # Gradients are freed before the forward, not after it: last step's (the draft's size
        # in fp32) would otherwise be alive through the forward's activation peak.
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        (loss / micro_batches).backward()

    def finish(self) -> float:
        params = [p for p in self.module.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.clip))
        self.optimizer.step()
        return grad_norm


def train_step(
    opt,
    head,
    micro_batches: list[dict],
    lr: float,
    cfg: LoopConfig,
    generator=None,
    prompt_weight=None,
    sp: SequenceParallel | None = None,
) -> dict:
    """One optimizer step over `micro_batches` (forward, TTT loss, backward each), the one
    step every backend runs: `opt` is a PlainOptimizer or the DeepSpeed engine's wrapper.
    `prompt_weight`: see `forward_batch` (`fit` passes the schedule's). Returns the step's
    figures, averaged over its micro-batches.

    `sp`: this rank scores its rows of the group's batch (eagle3.sequence_parallel). The
    data-parallel engine averages gradients over every rank, dp x sp of them, while the sp
    ranks of a group hold shares of one batch's loss: each share is scaled by sp, so the
    average is the mean over the dp batches, as without the split. The figures returned are
    the group's sums (the whole batch's), the same on each of its ranks."""
    opt.begin(lr)
    opt.module.configure_training(
        cfg.activation_checkpointing == "mlp", (cfg.dropout, generator) if cfg.dropout else None
    )
    scores = []
    for batch in micro_batches:
        with autocast_for(cfg.compute_dtype, batch["input_ids"].device):
            s = forward_batch(
                opt.module,
                head,
                batch,
                cfg.ttt,
                train=True,
                generator=generator,
                objective=cfg.objective,
                prompt_weight=prompt_weight,
                sp=sp,
            )
        opt.backward(s.loss * sp.size if sp is not None else s.loss, len(micro_batches))
        scores.append(s if sp is None else group_figures(s, sp))
    grad_norm = opt.finish()
    n, steps = len(scores), range(len(scores[0].step_acc_t))
    return {
        "loss": sum(float(s.loss.detach()) for s in scores) / n,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_acc": [sum(s.step_acc[j] for s in scores) / n for j in steps],
        "step_loss": [sum(s.step_loss[j] for s in scores) / n for j in steps],
        "step_alpha": [sum(s.step_alpha[j] for s in scores) / n for j in steps],
    }


def group_figures(s: StepScores, sp: SequenceParallel) -> StepScores:
    """A rank's StepScores with its loss and per-step figures summed over its group (one
    all-reduce): the whole batch's figures. The per-row tensors stay this rank's."""
    steps = len(s.step_loss_t)
    parts = [s.loss.detach().reshape(1), s.step_loss_t, s.step_acc_t, s.step_alpha_t]
    summed = sp.sum(torch.cat([p.double() for p in parts])).to(s.step_loss_t.dtype)
    loss, step_loss, step_acc, step_alpha = summed.split([1, steps, steps, steps])
    return dataclasses.replace(s, loss=loss[0], step_loss_t=step_loss, step_acc_t=step_acc, step_alpha_t=step_alpha)


@torch.no_grad()
def evaluate(draft, head, batches: Iterable[dict], cfg: LoopConfig) -> dict:
    """Per-step accuracy and simulated acceptance (walk and per-position average)."""
    draft.eval()
    total_acc = None
    hits = alphas = counts = None
    for batch in batches:
        with autocast_for(cfg.compute_dtype, batch["input_ids"].device):
            s = forward_batch(draft, head, batch, cfg.ttt, train=False, objective=cfg.objective)
        length = len(s.step_acc_t)
        if hits is None:
            hits, alphas, counts = [0.0] * length, [0.0] * length, [0.0] * length
        for j in range(length):
            w = s.weights[..., j]
            hits[j] += float((s.correct[..., j].float() * w).sum())
            alphas[j] += float(s.step_alpha_t[j]) * float(w.sum())
            counts[j] += float(w.sum())
        acc = acceptance(
            s.correct,
            batch["loss_mask"],
            batch["attention_mask"],
            cfg.acceptance_k,
            segment_ids=batch.get("segment_ids"),
        )
        total_acc = acc if total_acc is None else total_acc.merge(acc)
    out = {
        "step_acc": [h / c if c else float("nan") for h, c in zip(hits or [], counts or [])],
        "step_alpha": [a / c if c else float("nan") for a, c in zip(alphas or [], counts or [])],
    }
    if total_acc is not None:
        out.update(total_acc.as_dict())
    return out


@dataclass
class LoopHooks:
    """What the loop asks of its caller; every hook is optional."""

    evaluate: Callable[[], dict | None] | None = None  # held-out figures (None: this rank only waits)
    log: Callable[[dict], None] | None = None  # a step's record, at log cadence
    checkpoint: Callable[[int, dict | None, dict | None], None] | None = None  # (steps done, best, last eval)
    # (this worker's loss, tokens) -> the mean loss and the total tokens over all workers
    reduce: Callable[[float, int], tuple[float, int]] | None = None
    # (steps done, state) after each evaluation -> True ends the run there: an early stop
    # (bench.bench_quality's patience); the step is logged, and checkpointed where due
    stop: Callable[[int, "LoopState"], bool] | None = None


@dataclass
class LoopState:
    last_eval: dict | None = None
    best: dict | None = None  # {"step", "acceptance_walk"} of the best evaluation so far
    stopped_at: int | None = None  # steps done when `LoopHooks.stop` ended the run early


def fit(
    opt,
    head,
    next_batches: Callable[[], list[dict]],
    cfg: LoopConfig,
    generator: torch.Generator,
    hooks: LoopHooks | None = None,
    start: int = 0,
    best: dict | None = None,
    average: WeightAverage | None = None,
    sp: SequenceParallel | None = None,
) -> LoopState:
    """Train from step `start` to `cfg.steps`: each step takes its micro-batches from
    `next_batches()`, at the learning rate of the warmup + cosine schedule. Evaluates every
    `eval_every` steps, at the end and before each checkpoint (so a checkpoint knows its
    best); logs step 0, every `log_every` steps and the end, whether or not the run was
    resumed in between; checkpoints every `checkpoint_every` steps and at the end.

    `average` (cfg.ema_decay > 0) is updated after each step, and evaluation sees its
    weights; the checkpoint hook gets the raw ones in the module, the caller saves both.
    `sp`: this rank's sequence-parallel group (`train_step`)."""
    hooks = hooks or LoopHooks()
    state = LoopState(best=best)
    t0, tokens_since = time.perf_counter(), 0
    horizon = cfg.optim.horizon_steps or cfg.steps  # the learning rate's and the prompt fade's
    for step in range(start, cfg.steps):
        micro = next_batches()
        prompt_weight = cfg.objective.prompt_weight(step, horizon)
        figures = train_step(opt, head, micro, lr_at(step, horizon, cfg.optim), cfg, generator, prompt_weight, sp)
        if average is not None:
            average.update()
        loss, tokens = figures["loss"], sum(int(b["attention_mask"].sum()) for b in micro)
        if hooks.reduce is not None:
            loss, tokens = hooks.reduce(loss, tokens)
        tokens_since += tokens
        done = step + 1
        record = {"step": step, **figures, "loss": loss, "tokens": tokens}
        checkpoint_now = hooks.checkpoint is not None and (
            done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
        )
        if hooks.evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.steps or checkpoint_now):
            with average.applied() if average is not None else contextlib.nullcontext():
                state.last_eval = record["eval"] = hooks.evaluate()
            walk = state.last_eval["acceptance_walk"] if state.last_eval else None
            if walk is not None and (state.best is None or walk > state.best["acceptance_walk"]):
                state.best = {"step": done, "acceptance_walk": walk}
            if hooks.stop is not None and done < cfg.steps and hooks.stop(done, state):
                state.stopped_at = done
        last = done == cfg.steps or state.stopped_at is not None
        if hooks.log is not None and (done % cfg.log_every == 0 or step == 0 or last):
            record["tokens_per_s"] = tokens_since / max(time.perf_counter() - t0, 1e-9)
            hooks.log(record)
            t0, tokens_since = time.perf_counter(), 0
        if checkpoint_now:
            hooks.checkpoint(done, state.best, state.last_eval)
        if state.stopped_at is not None:
            break
    return state


def train_in_memory(
    draft: Eagle3Draft,
    head: TargetHead,
    batches: list[dict],
    cfg: LoopConfig,
    eval_batches: list[dict] | None = None,
    *,
    eval_cfg: LoopConfig | None = None,
    stop: Callable[[int, LoopState], bool] | None = None,
    checkpoint: Callable[[int, dict | None, dict | None, dict], None] | None = None,
    resume: dict | None = None,
) -> list[dict]:
    """`fit` with the plain optimizer over `batches`, one a step, in turn; returns the logged
    records (step 0, every `log_every` steps, the last), each with its held-out figures
    (`evaluate` on `eval_batches`, with `eval_cfg`'s TTT length and k, default `cfg`'s) where
    one was due. `stop` may end the run early after an evaluation (`LoopHooks.stop`).

    With `cfg.ema_decay`, the draft ends holding the weight average (what was evaluated).

    `checkpoint(done, best, last_eval, loop)` is called every `checkpoint_every` steps and
    at the end, `loop` holding what a resume needs besides the draft's (raw) weights: the
    step, the best evaluation, the optimizer's and the noise generator's states, and with
    `cfg.ema_decay` the weight average (`loop["average"]["average"]`: the evaluated
    weights, by name). `resume=loop` (with the draft's raw weights of that step already
    loaded) goes on from there, exactly."""
    if not batches:
        raise ValueError("train_in_memory got no batches")
    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device=batches[0]["input_ids"].device).manual_seed(cfg.seed)
    opt = PlainOptimizer(draft, cfg.optim)
    average = WeightAverage(draft, cfg.ema_decay) if cfg.ema_decay else None
    start, best = 0, None
    if resume is not None:
        opt.optimizer.load_state_dict(resume["optimizer"])
        generator.set_state(resume["generator"])
        start, best = resume["step"], resume["best"]
        if average is not None:
            average.load_state_dict(resume["average"])
    taken = iter(range(start, cfg.steps))
    history: list[dict] = []

    def save(done: int, best: dict | None, last_eval: dict | None) -> None:
        loop = {"step": done, "best": best, "optimizer": opt.optimizer.state_dict(), "generator": generator.get_state()}
        if average is not None:
            loop["average"] = average.state_dict()
        checkpoint(done, best, last_eval, loop)

    hooks = LoopHooks(
        log=history.append,
        evaluate=None if eval_batches is None else (lambda: evaluate(draft, head, eval_batches, eval_cfg or cfg)),
        stop=stop,
        checkpoint=None if checkpoint is None else save,
    )
    fit(
        opt,
        head,
        lambda: [batches[next(taken) % len(batches)]],
        cfg,
        generator,
        hooks,
        start=start,
        best=best,
        average=average,
    )
    if average is not None:  # the trained draft is the average, as the train stage saves it
        average.copy_to_module()
    return history
