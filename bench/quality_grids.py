"""The settings bench.bench_quality compares: each grid is a list of (name, Hydra overrides),
one knob at a time away from the run's own settings, its first entry the baseline. The
comments keep what a setting was measured to do, so a grid reads as the record of its
ablations (docs/results.md has the tables)."""

# The tree the finalists are also decoded with: SGLang's default drafting for a Llama
# target (steps, topk, draft tokens); a block draft decodes its chain only.
TREE = (5, 4, 8)

GRIDS = {
    # One knob at a time away from the run's own settings.
    "knobs": [
        ("base", []),
        ("objective=log_acceptance", ["train.objective.kind=log_acceptance"]),
        ("objective=kl_acceptance", ["train.objective.kind=kl_acceptance"]),
        ("fc_norm", ["draft.fc_norm=true"]),
        ("norm_before_fc", ["draft.norm_before_fc=true"]),
        ("noise=none", ["train.ttt.noise.kind=none"]),
        ("noise=gaussian 0.2", ["train.ttt.noise.std=0.2"]),
        ("ttt=5", ["train.ttt.length=5", "train.acceptance_k=5"]),
        ("decay=1.0", ["train.ttt.decay=1.0"]),
        ("positions=fixed", ["train.ttt.positions=fixed"]),  # SpecForge 0.2.0's unshifted RoPE
        ("draft_vocab=2048", ["draft.draft_vocab_size=2048"]),
        ("lr=3e-4", ["train.optim.lr=3e-4"]),
        ("lr=2e-3", ["train.optim.lr=2e-3"]),
        ("tokens=answer", ["train.objective.tokens=answer"]),  # the loss mask only (SpecForge)
        ("init_head=target", ["draft.init_head=target"]),
        ("rope_theta=10000", ["draft.rope_theta=10000"]),
    ],
    # Why the project trailed SpecForge 0.2.0 at equal data: each of SpecForge's settings alone.
    "specforge": [
        ("project", []),
        ("noise=none", ["train.ttt.noise.kind=none"]),
        ("betas=0.9,0.999", ["train.optim.betas=[0.9,0.999]"]),
        ("normalise=positions", ["train.objective.normalise=positions"]),
        ("skip_unreachable", ["train.objective.skip_unreachable=true"]),
        ("schedule=specforge", ["train.optim.warmup_steps=55", "train.optim.min_lr_ratio=0"]),
        ("positions=fixed", ["train.ttt.positions=fixed"]),
        ("tokens=answer", ["train.objective.tokens=answer"]),
        (
            "all specforge",
            [
                "train.ttt.noise.kind=none",
                "train.optim.betas=[0.9,0.999]",
                "train.objective.normalise=positions",
                "train.objective.skip_unreachable=true",
                "train.objective.tokens=answer",
                "train.optim.warmup_steps=55",
                "train.optim.min_lr_ratio=0",
            ],
        ),
    ],
}
GRIDS["long"] = [  # issue 26: what limits held-out acceptance at convergence (10 epochs)
    ("base", []),
    ("min_lr_ratio=0", ["train.optim.min_lr_ratio=0"]),
    # Rebuilt store, seed 0 (2026-12-05): ahead of base at epochs 5 and 7-9, level at the end;
    # best walk 1.904 (step 3531) against 1.913
    ("weight_decay=0.1", ["train.optim.weight_decay=0.1"]),
    # Residual dropout in the draft layer. Rebuilt store, seed 0 (2026-12-05): level with base
    # through epoch 6, behind after; best walk 1.880 (step 3531) against base's 1.913
    ("dropout=0.1", ["train.dropout=0.1"]),
    # Evaluated, chosen and saved: the average of the weights over about the last 500 steps
    # (1.4 epochs here) instead of the last step's. Rebuilt store, seeds 0 and 1 (2026-12-05):
    # ahead of base on both seeds through epoch 8 (+0.074 at epoch 3), level at the end:
    # best walks 1.912 / 1.878 against base's 1.913 / 1.879. On a 3-epoch schedule (--steps
    # 1107, seed 0): 1.677 against 1.686, ahead at the first epoch only
    ("ema=0.998", ["train.ema_decay=0.998"]),
    # SmolLM2-135M's captured states (layers 1, 14, 26) have median |x| 0.8, 2.0 and 9.1: the
    # default std 0.05 barely touches them. Rebuilt store, seeds 0 and 1 (2026-12-04): best
    # walks 1.896 / 1.861 against base's 1.913 / 1.879, inside base's spread: no gain
    ("noise=gaussian 0.5", ["train.ttt.noise.std=0.5"]),
    # Rebuilt store, seed 0 (2026-12-05): within 0.031 of base at every epoch; best walk 1.904
    # (step 3690) against 1.913
    ("noise=uniform 0.5", ["train.ttt.noise.kind=uniform", "train.ttt.noise.std=0.5"]),
    # SpecForge's AdamW betas. Rebuilt store, seed 0 (2026-12-05): behind base at every epoch
    # (by 0.10-0.17 from the second), still rising at the end; best walk 1.804 (step 3690)
    # against 1.913
    ("betas=0.9,0.999", ["train.optim.betas=[0.9,0.999]"]),
    # Rebuilt store (2026-12-05): ahead of base on both seeds through epoch 6, then both dip;
    # patience 2 stopped seed 0 at 2568 (best 1.786 at 1926), seed 1 peaked at 1.879 (step
    # 3210) and fell to 1.840 by 3690: best walks 1.833 (1.786-1.879) against 1.896
    ("lr=5e-4", ["train.optim.lr=5e-4"]),
    # The validation walk of base still rose at every epoch of 10 (1.378 to 1.80, 2026-12-04):
    # the draft underfits the horizon rather than overfits it. Rebuilt store, seed 0: 1.281,
    # 1.339, 1.376 at epochs 1-3 against base's 1.388, 1.531, 1.585 (stopped there)
    ("lr=2e-3", ["train.optim.lr=2e-3"]),
    # Rebuilt store, seed 0 (2026-12-05): level, best walk 1.921 (step 3690) against 1.913,
    # x1.27 training tok/s; steps 5-6, drafted but never trained, lose 0.03-0.04 accuracy
    ("ttt=5", ["train.ttt.length=5"]),
    # Rebuilt store, seed 0 (2026-12-05): level, best walk 1.911 (step 3531) against 1.913;
    # step 0 up (acceptance rate 0.482 against 0.463), steps 1-6 down about as much
    ("decay=0.6", ["train.ttt.decay=0.6"]),
    ("tokens=answer", ["train.objective.tokens=answer"]),
    # Every position at first, the prompt's weighed down to 0 by half the run, answers after.
    # Rebuilt store, seed 0 (2026-12-05): behind base from the fifth epoch to the end; best
    # walk 1.876 (step 3531) against base's 1.913
    ("tokens=fade", ["train.objective.tokens=fade"]),
    ("draft_vocab=4096", ["draft.draft_vocab_size=4096"]),
    # 8192 slots hold 95.3% of the held-out answers' tokens, 16384 97.1% (vocab.json). Rebuilt
    # store, seeds 0-2 (2026-12-05): best walks 1.936 / 1.888 / 1.909 against base's 1.913 /
    # 1.879 / 1.843, ahead on each seed (mean +0.033), level up to epoch 9 and ahead after;
    # x0.70 training tok/s (its lm_head and loss twice as wide)
    ("draft_vocab=16384", ["draft.draft_vocab_size=16384"]),
    # The two settings that ended ahead of base on seed 0, together. Seed 0 (2026-12-05):
    # best walk 1.911 (step 3531) against 1.936 for vocab 16384 alone, 1.913 for base
    (
        "draft_vocab=16384+weight_decay=0.1",
        ["draft.draft_vocab_size=16384", "train.optim.weight_decay=0.1"],
    ),
    # Rebuilt store, seeds 0 and 1 (2026-12-05): seed 0 ahead of base from epoch 5 (1.925
    # against 1.913 at the end), seed 1 behind from epoch 7 (1.846 against 1.879): best walks
    # 1.886 (1.846-1.925) against 1.896 (1.879-1.913)
    ("objective=kl_acceptance", ["train.objective.kind=kl_acceptance"]),
    # Each position's step j weighed by its share of that position's expected accepted
    # length (0 once an earlier step misses) instead of decay**j everywhere. Seed 0 on the
    # rebuilt store (2026-12-04): walk 1.844 against base 1.913, step 0 ahead, steps 1-6 behind
    ("weighting=chain", ["train.objective.weighting=chain"]),
]
# Issue 47: the block draft (DFlash) against EAGLE-3 at equal data, from one store of both
# families' layers (run the bench with `capture.families=[eagle3,dflash]` in --overrides).
# Blocks of 8 serve 7 tokens a pass, EAGLE-3's chain of 7 likewise (evaluate.num_steps=7).
GRIDS["drafters"] = [
    ("eagle3", []),
    ("dflash", ["draft=dflash"]),  # 5 layers (DFlash's recipe), blocks of 8, 64 anchors a row
    ("dflash layers=1", ["draft=dflash", "draft.dflash.num_layers=1"]),  # EAGLE-3's draft cost
    # More blocks a row: 64 anchor a sixth of a ~370-token sample, 7 scored guesses each,
    # where EAGLE-3's TTT scores 7 at every row; at equal data the block draft sees fewer labels.
    ("dflash anchors=256", ["draft=dflash", "draft.dflash.num_anchors=256"]),
    ("dflash lr=3e-3", ["draft=dflash", "train.optim.lr=3e-3"]),
    # DFlash's own recipe shares the target's head, frozen: fewer weights to fit at small data.
    ("dflash head=target", ["draft=dflash", "draft.dflash.head=target"]),
    # Issue 50: DSpark (DFlash's backbone + Markov and confidence heads) at the paper's recipe:
    # blocks of 7, every slot a guess (7 a pass, as the rows above), 5 layers, rank 256.
    ("dspark", ["draft=dspark"]),
    ("dspark layers=1", ["draft=dspark", "draft.dspark.num_layers=1"]),  # EAGLE-3's layer count
    # The paper's own head: DeepSpec's drafts share the target's lm_head over the whole
    # vocabulary (SmolLM2's 49152 tokens here), the one layout SGLang's DSPARK serves.
    ("dspark head=target", ["draft=dspark", "draft.dspark.head=target", "draft.draft_vocab_size=49152"]),
]
