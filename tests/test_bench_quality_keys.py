"""bench.bench_quality's trial keys: a rerun reuses a kept trial only when what its figures
depend on is the same, and `--fit-samples` (training on part of the fit split) is one of those
things without changing the key of a trial on the whole split (kept trials stay reusable)."""

from bench.bench_quality import trial_key

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
