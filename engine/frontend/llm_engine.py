"""LLMEngine: add_request / step / abort_request — the synchronous core.

    add_request ──> Scheduler.waiting
    step():  Scheduler.schedule() ─> SchedulerOutput
             ModelRunner.execute() ─> sampled tokens
             Scheduler.update()     ─> tokens appended
             StopChecker.check()    ─> finished or not; detokenized text
             RequestOutput for every request that moved, as its output_kind asks
             (engine/frontend/request_state.py)

With async_scheduling, step() launches the next step before it commits the one
in flight (engine/frontend/async_step.py); the steps it cannot overlap, and
every step without it, run `sync_step` as above.

One engine is driven by one thread at a time (the offline LLM, or the service's
engine thread); it holds no locks of its own.
"""

from __future__ import annotations

import itertools
import operator

import torch

from engine.core.block_hash import salt_digest
from engine.config import EngineConfig
from engine.errors import ValidationError
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.model.cpu_allocator import release_freed_heap
from engine.model.model_info import ModelInfo, load_model
from engine.model.runner import Runner
from engine.outputs import RequestOutput
from engine.sampling.sampler import make_generator
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.sched_output import SchedulerOutput
from engine.sampling.sampler import SamplerOutput
from engine.spec_decode.speculator import Speculator
from engine.sampling.stopping import StopChecker
from engine.sampling.structured_outputs import StructuredOutputs
from engine.frontend.async_step import AsyncSteps
from engine.frontend.engine_stats import engine_stats
from engine.frontend.request_state import Request
from engine.frontend.prompt_logprobs import prompt_ends, settle_prompts
from engine.frontend.engine_parts import build_block_manager, build_kv_events, build_kv_offload
from engine.frontend.lora_adapters import LoRAAdapters
from engine.model.lora.request import LoRARequest
from engine.frontend.pooling_requests import check_request_kind, pooling_prompt, take_pooled
from engine.model.pooling.inputs import check_length
from engine.model.pooling.params import PoolingParams


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: Runner | None = None,
        model_info: ModelInfo | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        """`LLMEngine(config)` loads the model that `config` names.

        `runner` and `model_info` (both or neither) replace the model with any
        object that satisfies the Runner protocol; nothing is loaded, and
        `config.max_model_len` must then be set. `scheduler` replaces the
        scheduler the engine would build, its block manager with it.
        """
        if (runner is None) != (model_info is None):
            raise ValueError("pass runner and model_info together, or neither")
        if runner is None:
            config, model_info, runner = load_model(config)
        elif not config.max_model_len:
            raise ValueError("an engine around a given runner needs config.max_model_len")
        self.config = config
        self.runner = runner
        self.model_path = model_info.path
        self.tokenizer = model_info.tokenizer
        self.eos_token_ids = model_info.eos_token_ids
        self.vocab_size = model_info.vocab_size
        self.fingerprint = model_info.fingerprint
        self.pooling = model_info.pooling  # a pooling model's PoolingInfo; None: a generator
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.vocab_size,
                                                    self.eos_token_ids)
        if scheduler is None:
            block_manager = build_block_manager(config, runner)
            scheduler = Scheduler(config, block_manager,
                                  build_kv_offload(config, block_manager, runner, self.fingerprint))
        self.scheduler = scheduler
        self.offload = scheduler.offload
        self.block_manager = scheduler.block_manager
        if self.block_manager.num_blocks > runner.num_blocks:
            raise ValueError(
                f"the scheduler's {self.block_manager.num_blocks} KV blocks exceed the "
                f"runner's {runner.num_blocks}"
            )
        self.kv_events = build_kv_events(config, self.block_manager)
        spec = config.speculative_config
        self.speculator = None if spec is None else Speculator(spec, config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.loras = LoRAAdapters(runner, config.enable_lora)
        self._seq_ids = itertools.count()
        self.num_prompt_tokens = 0  # prompt tokens of every request added
        self.num_generation_tokens = 0  # tokens sampled, over all requests
        # Async scheduling's in-flight step (None: every step synchronous).
        self.overlap = AsyncSteps.build(self) if config.async_scheduling else None

    def close(self) -> None:
        """Stop the KV event publisher, the offload threads and the runner's
        worker processes, if any (safe to repeat)."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.offload is not None:
            self.offload.close()
        self.runner.close()

    @property
    def failure(self) -> str | None:
        """Why the engine cannot step any more even while idle (a tensor-parallel
        worker died), or None."""
        return self.runner.failure

    def publish_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.take_events())

    # -- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        token_type_ids: list[int] | None = None,
    ) -> None:
        """Queue a request: a text prompt (tokenized here) or prompt token ids.

        `add_special_tokens=False` is for text that already has them, such as a
        rendered chat template. `cache_salt` separates tenants in the prefix
        cache: requests share cached blocks only when their salts are equal. The
        service derives it from the authenticated caller, never from the client.
        `priority` orders requests under scheduling_policy="priority" (lower first);
        `lora_request`: the LoRA adapter it runs under (read now if not held).
        PoolingParams (a pooling engine): the answer is a vector, not tokens
        (engine/frontend/pooling_requests.py); `token_type_ids`: BERT's pair halves."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt, add_special_tokens)
        self.check_prompt(token_ids)
        self.check_params(params)
        pooling = params if isinstance(params, PoolingParams) else None
        params, carried = pooling_prompt(self.pooling, params, token_ids, token_type_ids)
        salt = salt_digest(cache_salt)
        lora_id, lora_key = self.loras.admit(lora_request)
        seqs, detokenizers, stop_checkers = [], [], []
        constraint = params.structured_outputs
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            grammar = None if constraint is None else self.structured_outputs.matcher(constraint)
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=index,
                prompt_token_ids=carried, params=params,
                generator=None if seed is None else make_generator(seed, self.runner.device),
                hash_extra=self.fingerprint, cache_salt=salt,
                fork_parent=seqs[0] if seqs else None, grammar=grammar, priority=priority,
                lora_id=lora_id, lora_key=lora_key)
            seqs.append(seq)
            detokenizer = IncrementalDetokenizer(  # none of a pooling request's text is read
                self.tokenizer if pooling is None else None, token_ids, params.skip_special_tokens)
            detokenizers.append(detokenizer)
            stop_checkers.append(StopChecker(params, self.eos_token_ids, self.config.max_model_len,
                                             len(token_ids), detokenizer, grammar))
        self.requests[request_id] = Request(
            request_id, text, token_ids, seqs, detokenizers, stop_checkers,
            [0] * params.n, [False] * params.n, pooling=pooling,
        )
        self.num_prompt_tokens += len(token_ids)
        if self.overlap is not None:
            self.overlap.note(request_id, params)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and give its blocks back. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")

    # -- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ------------------
    def add_lora(self, request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (ValidationError if it
        does not fit this model)."""
        self.loras.add(request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter once the requests running under it end; whether it was known."""
        return self.loras.remove(lora_id, self.requests)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.list()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def release_idle_memory(self) -> None:
        """Nothing left to run: give the heap's freed activations back to Linux.
        Why: while steps run, cpu_allocator keeps freed memory in the heap so
        the next step does not fault it in again, but an idle replica would hold
        its largest batch's activations for good (SmolLM2 after 32 streams:
        hundreds of MB over its weights and KV cache)."""
        if torch.device(self.runner.device).type == "cpu":
            release_freed_heap()

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError("this engine has no tokenizer: pass prompt token ids",
                                      "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, [_token_id(t) for t in prompt]

    def check_prompt(self, token_ids: list[int]) -> None:
        """Refuse a prompt the engine cannot run (reads only fixed settings: thread-safe)."""
        if not token_ids:
            raise ValidationError("the prompt is empty", "prompt")
        limit = self.config.max_model_len
        if self.pooling is not None:  # the prompt is all: no room for output needed
            check_length(token_ids, self.pooling, "prompt")
        elif len(token_ids) >= limit:
            raise ValidationError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room for output "
                f"within max_model_len={limit}", "prompt"
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValidationError(
                f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        """Refuse a logit_bias for a token id outside the vocabulary, a
        structured-output constraint that does not compile, and params of the
        kind this engine does not run (thread-safe)."""
        check_request_kind(self.pooling, params)
        if isinstance(params, PoolingParams):
            return
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValidationError(f"logit_bias: token id {bad} is outside the vocabulary "
                                  f"(0..{self.vocab_size - 1})", "logit_bias")
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and the model; report every request that moved
        (with async scheduling: the step before's, engine/frontend/async_step.py)."""
        if self.overlap is not None:
            return self.overlap.step()
        return self.sync_step()

    def sync_step(self) -> list[RequestOutput]:
        """One step, scheduled, run and reported before it returns."""
        if self.offload is not None:
            self.offload.poll()  # blocks that landed from the tiers join the prefix cache
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.offload is not None:
                self.offload.wait_for_loads(timeout=0.01)  # only the tiers are left to wait for
            self.publish_events()
            return []
        ends = prompt_ends(scheduled)  # max_tokens=0: the prompt is all; nothing samples
        result = self.runner.execute(scheduled)
        rows_of: dict[int, list[int]] = {}  # a sequence's rows: accepted drafts, then its token
        for row, seq_id in enumerate(result.seq_ids):
            rows_of.setdefault(seq_id, []).append(row)
        tokens = result.sampled.token_ids
        sampled = {seq_id: tokens[rows[-1]] for seq_id, rows in rows_of.items()}
        accepted = {seq_id: [tokens[row] for row in rows[:-1]]
                    for seq_id, rows in rows_of.items() if len(rows) > 1}
        self._record_drafts(scheduled, accepted)
        moved: dict[str, Request] = {}
        for seq in self.scheduler.update(scheduled, sampled, accepted):
            request = self.requests[seq.request_id]
            self.take_tokens(request, seq, rows_of[seq.seq_id], result.sampled)
            moved[request.request_id] = request
        take_pooled(self.requests, result.pooled, self.pooling)  # before settle ends them
        moved |= settle_prompts(self.requests, result.prompt_logprobs, ends, self._finish)
        if self.offload is not None:
            self.offload.after_step()  # copy out the blocks to store while they still exist
        outputs = self.report(moved)
        self.publish_events()  # the blocks this step cached, now computed
        if self.loras.pending:
            self.loras.settle(self.requests)
        return outputs

    def report(self, moved: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the requests that moved; the finished ones leave."""
        outputs = [request.output() for request in moved.values()]
        outputs = [output for output in outputs if output is not None]  # FINAL_ONLY waits
        for request in moved.values():
            if request.finished:
                del self.requests[request.request_id]
        return outputs

    def take_tokens(self, request: Request, seq: Sequence, rows: list[int],
                     sampled: SamplerOutput) -> None:
        """Check the step's new tokens of `seq` (appended by the scheduler) one by
        one, as if decoded one per step: logprobs, then stops. Tokens after one
        that stops the sequence are dropped."""
        first = len(seq.output_token_ids) - len(rows)
        for count, row in enumerate(rows, start=first + 1):
            self.num_generation_tokens += 1
            if seq.params.logprobs is not None:
                seq.output_logprobs.append(sampled.logprobs[row])
                seq.output_top_logprobs.append(sampled.top_logprobs[row])
            stop = request.stop_checkers[seq.index].check(seq.output_token_ids[count - 1], count)
            if stop is not None:
                seq.drop_last_outputs(len(seq.output_token_ids) - count)
                self._finish(seq, stop.finish_reason, stop.stop_reason)
                return

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _record_drafts(self, scheduled: SchedulerOutput, accepted: dict[int, list[int]]) -> None:
        """Tell the speculator how each draft fared."""
        if self.speculator is None:
            return
        for item in scheduled.sequences:
            if item.draft_token_ids:
                self.speculator.record(item.seq_id, len(item.draft_token_ids),
                                       len(accepted.get(item.seq_id, ())))

    # -- prefix cache and statistics -------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no running sequence holds."""
        self.block_manager.reset_prefix_cache()
        self.publish_events()
        return True

    def mark_popular(self, block_hashes: list[bytes]) -> int:
        """Make these blocks popular: evicted last, counted in prefix_warm_blocks (the
        fleet's warm-up, service/fleet/warmup.py). Replaces the previous set; returns how
        many were taken (popular blocks may fill only a bounded share of the cache)."""
        return self.block_manager.set_popular(block_hashes)

    def cached_prefix_blocks(self, chains: list[list[bytes]]) -> list[int]:
        """For each chain of block hashes, how many of its leading blocks are in the
        prefix cache now."""
        return [len(self.block_manager.cached_run(chain)) for chain in chains]

    def running_block_tables(self) -> list[tuple[int, list[int]]]:
        """For each running sequence that holds KV blocks, in the scheduler's order:
        (tokens whose K/V it has computed, a copy of its block table). What the
        offline benchmarks read between steps (bench/offline/driver.py)."""
        tables = self.block_manager.block_tables
        return [(seq.num_computed_tokens, list(tables[seq.seq_id]))
                for seq in self.scheduler.running if tables.get(seq.seq_id)]

    def stats(self) -> dict[str, int]:
        """Counters and gauges for monitoring (cumulative counters never go down)."""
        return engine_stats(self)

    def memory_per_rank(self) -> list[dict[str, int]]:
        """Bytes of weights and of KV cache held by each tensor-parallel rank
        (one entry without tensor parallelism)."""
        return self.runner.memory_per_rank()

    def offload_stats(self) -> dict | None:
        """Per tier hits, stores, bytes and usage, and the load/store counters (None: no tiers)."""
        return None if self.offload is None else self.offload.snapshot()


def _token_id(value) -> int:
    """An int token id (numpy integers welcome); anything else is a ValidationError."""
    if isinstance(value, bool):
        raise ValidationError(f"token id {value!r} is not an integer", "prompt")
    try:
        return operator.index(value)
    except TypeError:
        raise ValidationError(f"token id {value!r} is not an integer", "prompt") from None
