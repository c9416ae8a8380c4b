"""The report's acceptance by draft position: the engines' served figures (from their own
counters) beside the offline walk and the reference decoder, in the plot and in report.md."""

import pytest

from eagle3.metrics import SlotCounts
from workflows.evaluate.report import markdown, per_position_series, plot, served_per_position


def test_the_served_rate_by_position_is_the_slot_counts_rate_of_the_same_passes():
    """vLLM counts, per draft position, the drafts accepted there over all drafts; turned into
    P(accepted | reached) it is SlotCounts.rate of the same passes (no cut: vLLM counts each
    pass whole)."""
    accepted_per_pass = [0, 3, 1, 2, 3, 3, 0, 1]  # leading drafts each pass accepted, k = 3
    slots = SlotCounts.zeros(3)
    for m in accepted_per_pass:
        slots.record(m, remaining=10**6)
    counters = {
        "num_drafts": len(accepted_per_pass),
        "num_draft_tokens": 3 * len(accepted_per_pass),
        "num_accepted_tokens": sum(accepted_per_pass),
        "accepted_per_position": [sum(m > i for m in accepted_per_pass) for i in range(3)],
    }
    assert counters["accepted_per_position"] == [6, 4, 3]
    assert served_per_position(counters) == slots.rate == [6 / 8, 4 / 6, 3 / 4]
    # A position no pass reached has no rate, in both.
    never = {"num_drafts": 4, "accepted_per_position": [0, 0, 0]}
    slots = SlotCounts.zeros(3)
    for _ in range(4):
        slots.record(0, remaining=10**6)
    got = served_per_position(never)
    assert got[0] == slots.rate[0] == 0.0 and all(g != g for g in got[1:]) and all(r != r for r in slots.rate[1:])
    # No per-position counters (SGLang), or no drafts: nothing to show.
    assert served_per_position({"completion_tokens": [9], "verify_passes": [4]}) is None
    assert served_per_position({"num_drafts": 0, "accepted_per_position": []}) is None


def report_with_served() -> dict:
    """A report as the evaluate stage writes one, served by vLLM (per-position counters) and
    SGLang (none), k = 3."""
    return {
        "draft": "d",
        "target": "t",
        "prompts": 8,
        "max_new_tokens": 32,
        "num_steps": 3,
        "topk": 1,
        "acceptance_offline": 3.7,
        "acceptance_offline_per_position_average": 3.8,
        "acceptance_decoded": 3.76,
        "acceptance_decoded_sglang_definition": 3.88,
        "dtype": "float32",
        "serve_args": ["--speculative-algorithm", "EAGLE3"],
        "parity_ratio": 0.98,
        "lossless": True,
        "text_agreement": 1.0,
        "tokens_per_s_plain": 10.0,
        "tokens_per_s_decoded": 30.0,
        "speedup_decoded": 3.0,
        "per_position_acceptance_offline": [0.95, 0.99, 1.0],
        "per_position_acceptance": [0.9697, 1.0, 1.0],
        "acceptance_by_prompt_length_offline": {"<=64": 3.7},
        "acceptance_by_prompt_length_decoded": {"<=64": 3.76},
        "served": {
            "sglang": {
                "engine": "sglang 0.5.23",
                "device": "cpu",
                "dtype": "float32",
                "accept_length": 3.88,
                "predicted": 3.88,
                "predicted_from": "acceptance_decoded_sglang_definition",
                "served_over_predicted": 1.0,
                "matches_prediction": True,
                "identical_to_greedy": 8,
                "prompts": 8,
                "counters": {"completion_tokens": [33] * 8, "verify_passes": [8] * 8},
            },
            "vllm": {
                "engine": "vllm 0.32.0",
                "device": "cpu",
                "dtype": "float32",
                "accept_length": 3.879,
                "predicted": 3.879,
                "predicted_from": "acceptance_decoded_vllm_definition",
                "served_over_predicted": 1.0,
                "matches_prediction": True,
                "identical_to_greedy": 8,
                "prompts": 8,
                "counters": {"num_drafts": 66, "num_accepted_tokens": 190, "accepted_per_position": [64, 64, 62]},
                "per_position_acceptance": served_per_position(
                    {"num_drafts": 66, "accepted_per_position": [64, 64, 62]}
                ),
            },
        },
    }


def test_the_plot_sets_each_engines_served_figures_beside_offline_and_decoded(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    drawn = {}
    save = Figure.savefig

    def record(fig, path, *args, **kwargs):  # what each figure shows, as it is saved
        ax = fig.axes[0]
        drawn[path.name] = {
            "xticks": list(ax.get_xticks()),
            "xlim": ax.get_xlim(),
            "bars": {c.get_label(): [b.get_height() for b in c] for c in ax.containers},
        }
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    report = report_with_served()
    files = plot(report, tmp_path)
    assert files[0] == "per_position.png" and (tmp_path / "per_position.png").stat().st_size > 1000
    shown = drawn["per_position.png"]
    assert shown["xticks"] == [1, 2, 3] and shown["xlim"] == (0.5, 3.5)  # draft positions, never fractions
    assert shown["bars"] == {
        "offline (walk)": [0.95, 0.99, 1.0],
        "decoded": [0.9697, 1.0, 1.0],
        "served by vllm 0.32.0": pytest.approx([64 / 66, 1.0, 62 / 64]),
    }  # SGLang gives no per-position counters: no bars of its own
    assert [label for label, _ in per_position_series(report)] == list(shown["bars"])


def test_report_md_lists_the_served_figures_by_position():
    md = markdown(report_with_served(), ["per_position.png"])
    lines = md.splitlines()
    header = lines.index("| draft position | offline (walk) | decoded | served by vllm 0.32.0 |")
    assert lines[header + 1 : header + 5] == [
        "|---|---|---|---|",
        "| 1 | 0.950 | 0.970 | 0.970 |",
        "| 2 | 0.990 | 1.000 | 1.000 |",
        "| 3 | 1.000 | 1.000 | 0.969 |",
    ]
    # Without served figures the table holds the offline walk and the decoder only.
    bare = report_with_served()
    del bare["served"]
    assert "| draft position | offline (walk) | decoded |" in markdown(bare, [])
