"""bench.bench_quality's trial keys: a rerun reuses a kept trial only when what its figures
depend on is the same, and `--fit-samples` (training on part of the fit split) is one of those
things without changing the key of a trial on the whole split (kept trials stay reusable);
the table mixes no decoded figure of other prompts into a setting's row."""

from bench.bench_quality import as_decode_rows, trial_key
from bench.quality_report import summarise

TRIAL = {
    "base": ["+experiment=specforge_smollm2"],
    "overrides": ["draft=dspark"],
    "seed": 0,
    "steps": 369,
    "eval_every": 0,
    "patience": 0,
    "fraction": 0.1,
    "store": "0123456789ab",
}


def test_a_subset_of_the_fit_split_is_its_own_trial_and_the_whole_split_keeps_its_key():
    whole = trial_key(TRIAL)
    assert whole == "af32eb15d206"  # the key trials on the whole split were kept under
    assert trial_key({**TRIAL, "fit_samples": 0}) == whole
    keys = {trial_key({**TRIAL, "fit_samples": n}) for n in (80, 160)}
    assert len(keys) == 2 and whole not in keys
    assert trial_key({**TRIAL, "seed": 1}) != whole


def trial(seed: int, walk: float, decoded: float | None = None, on: str | None = None) -> dict:
    r = {"name": "dspark", "seed": seed, "acceptance_walk": walk, "best_step": 3690, "steps_done": 3690}
    r.update(train_tokens_per_s=100.0, step_acc=[0.4, 0.3], step_alpha=[0.35, 0.3])
    if decoded is not None:
        r.update(decoded_chain=decoded, lossless_chain=decoded > 1.5, decoded_on=on)
    return r


def test_the_table_takes_decoded_figures_only_from_this_runs_prompts():
    # seed 1 kept a decode of other prompts (validation) from an earlier run: it is not mixed
    # into the held-out figure, and its lossless flag does not speak for these prompts
    results = [trial(0, 1.6, 1.7, "heldout-key"), trial(1, 1.5, 1.2, "validation-key")]
    [row] = summarise(results, [("dspark", ["draft=dspark"])], "heldout-key")
    assert row["decoded_chain"] == (1.7, 1.7, 1.7)
    assert row["lossless"] is True
    assert row["acceptance_walk"] == (1.55, 1.5, 1.6)
    [row] = summarise(results, [("dspark", ["draft=dspark"])], None)
    assert row["decoded_chain"] is None


def test_an_evaluate_stage_row_becomes_its_prompt_and_answer_length():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]}, {"input_ids": [1, 2], "loss_mask": [0, 1]}]
    assert as_decode_rows(rows) == [{"prompt": [5, 6], "answer_len": 3}, {"prompt": [1], "answer_len": 1}]
