"""Stage `evaluate`: does the offline acceptance predict decoding? `<run_dir>/report/`.

For the same held-out answers and the same k draft tokens per target pass:

* **offline**: the training-time-test outputs of the draft, walked as greedy decoding
  walks the text (`eagle3.metrics`): the figure training reports;
* **decoded**: the reference speculative decoder (`eagle3.spec_decode`) with the
  exported draft on the answers' prompts, checked token for token against plain greedy
  decoding (`lossless`), timed against it (`speedup_decoded`).

When the evaluated drafting is a tree (`evaluate.topk > 1`), it is decoded a second time
with SGLang's draft attention (`Eagle3Drafter(sglang_compatible=True)`: from depth 3 on a
draft token attends to the frontier rank's KV slots, not its ancestors; see
`eagle3.spec_decode`), reported under `sglang_draft_attention`: the figure to compare with
SGLang's served accept length.

`parity_ratio = acceptance_offline / acceptance_decoded`; 1.0 means the offline figure
predicts decoding. Each answer is cut to `evaluate.max_new_tokens` on both sides, and
the target and draft run in `evaluate.dtype` on both sides, so a gap means the draft
behaves differently when decoding (or that the target's own greedy text differs from
the stored one: `text_agreement` says how often).

Precision: by default (`auto`) the figures are computed in the serving dtype (the export's,
`target.dtype`) wherever this machine runs it fast; the offline walk is then computed in
float32 too, and the report flags a gap above 2%. On a CPU without bf16 units (bf16 there
ran 30-60x slower than fp32) the evaluation runs in float32 and says so.

The draft scored is the one the train stage of this run produced: its export (the weights
as served, in the serving dtype) when the export was made from it, else its own weights.

* **served** (`evaluate.served`, `served`): the export served by the real engines, SGLang
  and vLLM, on the same prompts with the same drafting and dtype; each engine's own
  acceptance figure beside the prediction in its definition, flagged when they part by
  more than `evaluate.served_tolerance`, and its outputs against greedy decoding.
* **at a temperature** (`evaluate.temperature` > 0, `at_temperature`): the offline
  expectation from the per-step acceptance rates, the reference decoder sampling once per
  seed (pooled, with a standard error), and each engine served at that temperature.
* When greedy decoding and speculative decoding part on a prompt (`divergences`), the
  report names the prompt, the first token that differs and the target's top-2 logit
  margin there, and tells a numerical tie (within 4 ulps of the logit: bf16 kernels of
  different shapes can flip it) from a defect.

Modules: `stage` (the run), `decoding` (offline walk, reference decoder, temperature),
`served` (the served check), `report` (report.md and the plots).

    python -m workflows.evaluate target=tiny run_dir=runs/tiny"""

from workflows.evaluate.decoding import at_temperature, decode_all, decode_sampled, divergence, offline_acceptance  # noqa: F401
from workflows.evaluate.report import by_bucket, markdown  # noqa: F401
from workflows.evaluate.stage import evaluation_dtype, heldout_rows, run  # noqa: F401
