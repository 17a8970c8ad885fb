"""LLM: the offline API — generate() and chat() over a batch of prompts.

    from engine import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", block_size=16)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=64))
    print(outputs[0].outputs[0].text)

Every prompt is queued at once and the engine steps until all are done; the
continuous-batching scheduler decides what runs together. Outputs come back in
prompt order whatever order they finished in. Only whole answers are wanted, so
every request asks the engine for FINAL_ONLY outputs (as vLLM's LLM does): no
output is built, and no list copied, before a request finishes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from engine.frontend.chat_template import render_chat_text
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.model.lora.request import LoRARequest
from engine.frontend.pooling_requests import check_request_kind
from engine.model.pooling.inputs import embed_input, pair_input, truncated_ids
from engine.model.pooling.params import PoolingParams
from engine.model.pooling.pooler import PoolingInfo
from engine.model.pooling.scores import cosine_output, score_pairs
from engine.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from engine.sampling_params import SamplingParams

# A prompt is text, token ids, or {"prompt_token_ids": [...]} (vLLM's TokensPrompt).
Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        # Offline, nobody waits on a first request: the KV cache's pages are
        # backed as its blocks are first written, not all at start (a faster
        # start, fewer pages in all). Servers touch them at start.
        engine_args.setdefault("kv_cache_prefault", False)
        self._start(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._request_ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; one SamplingParams for all, or one per prompt;
        `lora_request` (enable_lora): the LoRA adapter of all, or one per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        items = [(_unwrap(p), sp, True, {"lora_request": lora})
                 for p, sp, lora in zip(prompts, params, loras)]
        return self._run(items, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, using the model's chat template.

        `tools` (OpenAI's function objects) go to the template's `tools`
        variable; reading calls out of the text is the HTTP service's part.
        `chat_template_kwargs` are more template variables, as in vLLM
        (`{"enable_thinking": False}` for Qwen3).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = _params_per_prompt(sampling_params, len(conversations))
        loras = _per_prompt(lora_request, len(conversations), "lora_request")
        tokenizer = self.get_tokenizer()
        items = []
        for conversation, sp, lora in zip(conversations, params, loras):
            text = render_chat_text(tokenizer, conversation, add_generation_prompt, tools,
                                    chat_template_kwargs)
            # The template already placed the special tokens.
            items.append((text, sp, False, {"lora_request": lora}))
        return self._run(items, use_tqdm)

    # -- pooling models (runner="pooling"; vLLM's offline names) ------------------------
    def embed(self, prompts: Prompt | SequenceABC[Prompt],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              prompt_name: str | None = None, truncate_prompt_tokens: int | None = None
              ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`), tokenized as
        sentence-transformers does (its `prompt_name` prefix included)."""
        params = pooling_params or PoolingParams(task="embed")
        items = [(*self._pooling_input(p, prompt_name, truncate_prompt_tokens), params)
                 for p in _as_prompt_list(prompts)]
        return self._run_pooling(items, use_tqdm)

    def classify(self, prompts: Prompt | SequenceABC[Prompt], use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A classifier's label probabilities for each prompt (`outputs.probs`)."""
        params = PoolingParams(task="classify")
        items = [(*self._pooling_input(p, None, truncate_prompt_tokens), params)
                 for p in _as_prompt_list(prompts)]
        return self._run_pooling(items, use_tqdm)

    def score(self, text_1: str | list[str], text_2: str | list[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each pair's score (`outputs.score`): one text_1 against every text_2, or
        pair by pair. A cross-encoder scores the pair as one input; an embedding
        model answers the cosine similarity of the two embeddings."""
        pairs = score_pairs(text_1, text_2)
        info, tokenizer = self.engine.pooling, self.get_tokenizer()
        if info is not None and info.task == "embed":
            firsts = self.embed([a for a, _ in pairs], use_tqdm=use_tqdm,
                                truncate_prompt_tokens=truncate_prompt_tokens)
            seconds = self.embed([b for _, b in pairs], use_tqdm=use_tqdm,
                                 truncate_prompt_tokens=truncate_prompt_tokens)
            return [cosine_output(a, b) for a, b in zip(firsts, seconds)]
        params = PoolingParams(task="score")
        items = [(*pair_input(tokenizer, self._pooling_info(), a, b, truncate_prompt_tokens),
                  params) for a, b in pairs]
        return self._run_pooling(items, use_tqdm)

    def encode(self, prompts: Prompt | SequenceABC[Prompt], pooling_params: PoolingParams,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's answer as `pooling_params` asks (its task: embed or classify)."""
        items = [(*self._pooling_input(p, None, None), pooling_params)
                 for p in _as_prompt_list(prompts)]
        return self._run_pooling(items, use_tqdm)

    def _pooling_info(self) -> PoolingInfo:
        check_request_kind(self.engine.pooling, PoolingParams())
        return self.engine.pooling

    def _pooling_input(self, prompt: Prompt, prompt_name, truncate):
        info, prompt = self._pooling_info(), _unwrap(prompt)
        if isinstance(prompt, str):
            return embed_input(self.get_tokenizer(), info, prompt, prompt_name, truncate, "prompt")
        return truncated_ids(prompt, info, truncate, "prompt"), None

    def _run_pooling(self, items, use_tqdm: bool) -> list[PoolingRequestOutput]:
        """(token ids, token types, params) per prompt: tokenized here, no special tokens added."""
        return self._run([(ids, params, False, {"token_type_ids": types})
                          for ids, types, params in items], use_tqdm)

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, params, add_special, extra in items:
                request_id = str(next(self._request_ids))
                params = _final_only(params)
                engine.add_request(request_id, prompt, params, add_special_tokens=add_special,
                                   **extra)
                ids.append(request_id)
            finished: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
            return [finished[i] for i in ids]
        except BaseException:
            for request_id in ids:  # a bad prompt or Ctrl-C must not leave blocks held
                engine.abort_request(request_id)
            raise


def _final_only(params: SamplingParams) -> SamplingParams:
    """The caller's settings, asking for one whole output per request (a pooling
    request has only that one)."""
    if isinstance(params, PoolingParams) or params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # a single prompt given as token ids
    return list(prompts)


def _unwrap(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    return _per_prompt(params, count, "SamplingParams")


def _per_prompt(value, count: int, what: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if value is None or not isinstance(value, SequenceABC):
        return [value] * count
    value = list(value)
    if len(value) != count:
        raise ValueError(f"got {len(value)} {what} for {count} prompts")
    return value
