"""SGLang's model runner driven directly: the aux and the final states of one forward.

Why not the Engine: asked for hidden states, `sgl.Engine` sends them from its scheduler
through the detokenizer and tokenizer processes as Python lists (a capture then runs at
0.70-0.75 of a bare prefill on CPU, measured), and in aux mode it returns the aux states
*instead of* the final one. SGLang's `ModelRunner`, driven the way SGLang's own
`sglang.benchmark.one_batch` drives it (load, build an extend batch, forward), hands both
back as tensors: with `enable_return_aux_hidden_states` its logits processor keeps the final,
normed states (`last_hidden_states`) next to the packed aux ones (`hidden_states`). One
forward, no lists, and SGLang's own loader, so quantized checkpoints work too. This is SGLang
0.5.23's internal API, pinned by the project; `tests/test_capture.py` checks the states
against HF's.

Tensor parallelism: rank 0 runs in the capture worker; ranks 1.. are processes it spawns,
which load their shard and follow rank 0's requests, broadcast over the TP group's CPU group
(all ranks must run every forward: the layers all-reduce).
"""

from __future__ import annotations

import multiprocessing

from workflows.core.engine_spec import EngineSpec
from workflows.core.sglang import engine_kwargs, exit_with_parent


def _server_args(spec: EngineSpec, request: list[int]):
    from sglang.srt.server_args import ServerArgs

    # No CUDA graphs: decode graphs never run for a prefill, and a prefill graph's replays share
    # one output buffer (each micro-batch's states would be overwritten by the next one's).
    # chunked_prefill_size = the micro-batch, so SGLang's memory plan reserves its activations.
    args = ServerArgs(
        **engine_kwargs(
            spec,
            disable_radix_cache=True,
            enable_return_hidden_states=True,
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=request,
            disable_cuda_graph=True,
            chunked_prefill_size=spec.micro_batch_tokens,
        )
    )
    args.resolve_once()
    return args


class CaptureRunner:
    """One TP rank of the target in SGLang's ModelRunner. Rank 0's `forward` returns
    (aux [T, k*H], final [T, H]) for the concatenated sequences; the other ranks `follow`."""

    def __init__(self, spec: EngineSpec, request: list[int], server_args, port_args, tp_rank: int):
        import torch
        from sglang.benchmark import one_batch

        self._ob, self.tp_rank, self.tp_size = one_batch, tp_rank, spec.tp_size
        one_batch.publish(
            server_args,
            role="scheduler",
            ranks=one_batch.SpawnRanks(
                world_rank=one_batch.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank
            ),
        )
        one_batch._init_process_global_configs()
        if spec.threads:
            torch.set_num_threads(spec.threads)
        bench_runner, _ = one_batch.load_model(server_args, port_args, tp_rank, tp_rank)
        self.runner = bench_runner.torch_runner
        self._clear = bench_runner.clear
        if self.tp_size > 1:
            from sglang.srt.runtime_context import get_parallel

            self._group = get_parallel().tp_group.cpu_group

    def _broadcast(self, message):
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def states(self, seqs: list[list[int]], token_budget: int, capture: bool = True):
        """Prefill `seqs` in micro-batches of at most `token_budget` tokens (a longer sequence
        alone), each within the KV pool and the request pool. capture: (aux, final) of all the
        tokens, in order, on the CPU; else None (the benchmark's bare forward: the same
        prefills, nothing kept)."""
        import torch

        runner = self.runner
        pool, context = runner.max_total_num_tokens, runner.model_config.context_len
        longest = max(map(len, seqs))
        if longest > min(pool, context):
            raise ValueError(
                f"a sequence of {longest} tokens does not fit SGLang's KV pool of {pool} tokens "
                f"or the target's context of {context} (the CPU pool is 4096 tokens; on GPUs SGLang "
                "sizes it from its memory fraction)"
            )
        outs = []
        for group in micro_batches(seqs, min(max(token_budget, 1), pool), runner.req_to_token_pool.size):
            out = self.forward(group, capture)
            # To the CPU now: the next forward may reuse the device buffers these views point into.
            outs.append(out and tuple(t.cpu() for t in out))
        if not capture:
            return None
        return tuple(torch.cat([out[k] for out in outs]) for k in (0, 1))

    def forward(self, seqs: list[list[int]], capture: bool = True):
        """Prefill `seqs` as one batch. capture: (aux, final) tensors on the runner's device;
        else None."""
        if self.tp_size > 1 and self.tp_rank == 0:
            self._broadcast((seqs, capture))
        return self._forward(seqs, capture)

    def _forward(self, seqs, capture):
        import torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        ob, runner = self._ob, self.runner
        reqs = ob.prepare_synthetic_inputs_for_latency_test(len(seqs), 0, custom_inputs=seqs)
        # No prefix cache: every token is prefilled, so every token's state comes back.
        cache = ob.TreeCacheNamespace(
            page_size=ob.get_schedule().page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        try:
            with torch.no_grad():
                batch = ScheduleBatch.init_new(
                    reqs=reqs,
                    req_to_token_pool=runner.req_to_token_pool,
                    token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                    tree_cache=cache,
                    model_config=runner.model_config,
                    enable_overlap=False,
                    spec_algorithm=SpeculativeAlgorithm.NONE,
                )
                batch.prepare_for_extend()
                ob._maybe_prepare_mlp_sync_batch(batch, runner)
                if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                    batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
                    batch.prefill_input_ids_cpu = None
                # FULL: every token's states; NULL for the bare forward (the server's default
                # mode is FULL, which would make the baseline pay for the capture too).
                mode = CaptureHiddenMode.FULL if capture else CaptureHiddenMode.NULL
                forward_batch = ForwardBatch.init_new(
                    batch, runner, capture_hidden_mode=mode, return_hidden_states_before_norm=False
                )
                out = runner.forward(forward_batch).logits_output
        finally:
            self._clear()  # the KV pool holds one call's tokens at a time
        if not capture or self.tp_rank != 0:
            return None
        total = sum(map(len, seqs))
        aux, final = out.hidden_states, out.last_hidden_states
        if aux is None or final is None or aux.shape[0] != total or final.shape[0] != total:
            raise RuntimeError(
                f"SGLang's runner returned aux {None if aux is None else tuple(aux.shape)} and "
                f"final {None if final is None else tuple(final.shape)} states for {total} tokens"
            )
        return aux, final

    def follow(self) -> None:
        """Ranks 1..: run each forward rank 0 broadcasts, until it broadcasts None."""
        while (message := self._broadcast(None)) is not None:
            self._forward(*message)

    def close(self) -> None:
        if self.tp_size > 1 and self.tp_rank == 0:
            self._broadcast(None)


def micro_batches(seqs: list[list[int]], budget: int, max_seqs: int | None = None) -> list[list[list[int]]]:
    """Consecutive groups of `seqs` of at most `budget` tokens (a longer sequence alone) and at
    most `max_seqs` sequences each."""
    groups, tokens = [], budget + 1
    for seq in seqs:
        if tokens + len(seq) > budget or (max_seqs is not None and len(groups[-1]) >= max_seqs):
            groups.append([])
            tokens = 0
        groups[-1].append(seq)
        tokens += len(seq)
    return groups


def _follower(spec_fields: dict, request: list[int], server_args, port_args, tp_rank: int) -> None:
    exit_with_parent()
    CaptureRunner(EngineSpec(**spec_fields), request, server_args, port_args, tp_rank).follow()


def start(spec: EngineSpec, request: list[int]) -> tuple[CaptureRunner, list]:
    """Rank 0's runner in this process, and the processes of ranks 1.. (already following)."""
    from sglang.benchmark.one_batch import PortArgs
    from sglang.srt.entrypoints.engine import _set_envs_and_config

    server_args = _server_args(spec, request)
    _set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    followers = [
        context.Process(target=_follower, args=(vars(spec), request, server_args, port_args, rank), daemon=True)
        for rank in range(1, spec.tp_size)
    ]
    for process in followers:
        process.start()
    return CaptureRunner(spec, request, server_args, port_args, 0), followers
