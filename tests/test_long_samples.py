"""Long samples through what sees their length in generate and capture: on a random 4-layer
Llama that serves 40K positions (the tiny target serves 2,048), a 33,000-token prompt is
answered as the model's own greedy decoding answers it (its first token), its states are captured whole
(alone in its forward, being past capture.micro_batch_tokens, next to short samples batched
together) equal to a direct forward's, and the store keeps them exactly over several Zarr
chunks (bf16). Float32 on the CPU: a few seconds (sdpa's causal kernel, no T x T mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

LONG, CAPTURE_IDS = 33_000, [0, 1, 2]


@pytest.fixture(scope="module")
def long_target(tiny_target, tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("long_target")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,  # the captured layers' outputs are HF's hidden_states, the last one normed
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=40_000,
        attn_implementation="sdpa",
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(folder)
    return folder


@pytest.mark.slow  # three forwards of 33,000 tokens: ~10 s on 2 cores
def test_a_33k_token_sample_is_answered_and_captured_whole_and_stored_exactly(long_target, tmp_path):
    from storage.reader import StoreReader
    from storage.states import encode_states
    from storage.store import HiddenStateStore, ShardData
    from storage.zarr_io import chunk_rows
    from workflows.core.engine_spec import EngineSpec, micro_batches
    from workflows.core.engines import HFEngine

    engine = HFEngine(EngineSpec(str(long_target), capture_ids=CAPTURE_IDS, micro_batch_tokens=4096))
    g = torch.Generator().manual_seed(1)
    long = torch.randint(3, 1024, (LONG,), generator=g).tolist()
    short = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (40, 70)]

    # Capture: alone in its forward, whole, equal to the decoder's own layers.
    assert micro_batches([len(short[0]), LONG, len(short[1])], 4096) == [[0, 2], [1]]
    states = engine.states([short[0], long, short[1]])
    aux, final = states[1]
    assert aux.shape == (LONG, 3 * 32) and final.shape == (LONG, 32)
    with torch.no_grad():  # the decoder's own forward: the reference for both checks
        out = engine.model.model(input_ids=torch.tensor([long]), output_hidden_states=True)
        first = int(engine.model.lm_head(out.last_hidden_state[0, -1]).argmax())

    layers = torch.cat([out.hidden_states[i + 1][0] for i in CAPTURE_IDS], dim=-1)
    torch.testing.assert_close(aux, layers, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, out.last_hidden_state[0], rtol=1e-5, atol=1e-5)

    # Generate: the engine's answer to the long prompt starts with the model's greedy token.
    ((answer, _),) = engine.generate([long], max_new_tokens=3, temperature=0.0)
    assert len(answer) >= 1 and answer[0] == first

    # Store: the 33K sample beside a short one, read back bit for bit (bf16), over several chunks.
    assert chunk_rows(3 * 32 * 2) * 2 < LONG  # the aux array's rows per Zarr chunk
    prov = {"hidden_size": 32, "capture_layer_ids": CAPTURE_IDS, "final_is_normed": True, "target": {}}
    store = HiddenStateStore.create_or_open(str(tmp_path / "store"), {**prov, "state_dtype": "bfloat16"})
    lengths = [LONG, len(short[0])]
    data = ShardData(
        sample_ids=["long", "short"],
        input_ids=np.array(long + short[0], dtype=np.int32),
        loss_mask=np.ones(sum(lengths), dtype=np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        **encode_states([states[1], states[0]], "bfloat16"),
    )
    store.commit([store.write_shard("train-00000", data)])
    back = StoreReader(str(tmp_path / "store")).sample("long")
    assert back["input_ids"].tolist() == long
    assert torch.equal(back["aux"], aux.to(torch.bfloat16)) and torch.equal(back["final"], final.to(torch.bfloat16))
