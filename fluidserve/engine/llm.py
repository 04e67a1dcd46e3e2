"""Offline batch API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from fluidserve.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.metrics import RequestLatency, request_latency
from fluidserve.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    metrics: RequestLatency | None = None
    logprobs: list = field(default_factory=list)
    num_cached_tokens: int | None = None  # with prefix caching: prompt tokens found cached
    # With SamplingParams.prompt_logprobs: for each prompt token from the second on, its
    # (logprob, [(id, logprob), ...], rank) given the tokens before it (the top ones, and
    # 1 + the number of tokens more likely than it)
    prompt_logprobs: list | None = None
    # What stopped it, as vLLM's: the stop string matched, or the one of stop_token_ids
    # (None: EOS, the length, an error)
    stop_reason: int | str | None = None
    prompt: str | None = None  # the prompt, when given as text
    index: int = 0  # its sample of SamplingParams.n
    samples: list[CompletionOutput] = field(default_factory=list, repr=False)  # the others

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every sample of the prompt (``SamplingParams.n``), this one first: as vLLM's
        ``RequestOutput.outputs``, so that ``llm.generate(...)[i].outputs[0].text`` reads
        the same here."""
        return [self, *self.samples]


class LLM:
    """Runs prompts to completion on one engine.

    Keyword arguments are engine knobs by their flag names (``token_budget=256``,
    ``scheduler="vllm"``, ``tensor_parallel_size=2``), or pass a whole ``config``.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **knobs) -> None:
        if config is None:
            config = EngineConfig.create(model=model, **knobs)
        elif knobs or model is not None:
            config = config.replace(**knobs, **({"model": model} if model else {}))
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0
        # An LLM dropped without close() stops its worker processes when it is collected.
        self._close = weakref.finalize(self, self.engine.shutdown)

    def close(self) -> None:
        """Stop worker processes (tensor/pipeline parallelism); also on leaving a ``with``,
        or when the LLM is garbage-collected."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run each prompt to completion. A prompt is text, token ids, or, as vLLM's, a dict
        ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [_prompt(p) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        eng = self.engine
        order, reqs = [], {}  # (order: each prompt's request ids, its samples')
        texts: dict[str, list[str]] = {}
        logprobs: dict[str, list] = {}
        prompt_logprobs: dict[str, list] = {}
        stop_reasons: dict[str, int | str | None] = {}
        bar = None
        try:  # a prompt refused, an interrupt, a dead executor: nothing is left running
            for prompt, p in zip(prompts, params, strict=True):
                group = []
                for j in range(p.n):  # (the first tokenizes; the others take its ids)
                    rid = f"gen-{self._counter}"
                    self._counter += 1
                    if j:
                        first = reqs[group[0]]
                        reqs[rid] = eng.add_request(rid, first.prompt_token_ids,
                                                    first.params.sample(j))
                    else:
                        reqs[rid] = eng.add_request(rid, prompt, p.sample(0) if p.n > 1 else p)
                    group.append(rid)
                    texts[rid], logprobs[rid] = [], []
                order.append(group)
            bar = _progress(len(reqs)) if use_tqdm else None
            while eng.has_unfinished():
                for out in eng.step():
                    if out.request_id not in texts:  # of an earlier call that was cut short
                        continue
                    texts[out.request_id].append(out.new_text)
                    logprobs[out.request_id].extend(out.new_logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        stop_reasons[out.request_id] = out.stop_reason
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in reqs:
                eng.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        results = []
        for prompt, group in zip(prompts, order, strict=True):
            outs = [self._result(reqs[rid], "".join(texts[rid]), logprobs[rid],
                                 prompt_logprobs.get(rid), stop_reasons.get(rid))
                    for rid in group]
            for j, out in enumerate(outs):
                out.index, out.prompt = j, prompt if isinstance(prompt, str) else None
            outs[0].samples = outs[1:]
            results.append(outs[0])
        return results

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Reply to a conversation (a list of ``{"role", "content"}`` messages), or to each
        of a list of them, rendered with the tokenizer's chat template as the server's chat
        endpoint renders it (as vLLM's ``LLM.chat``)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer, so no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False: the"
                             " last turn goes on, no new one opens")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.chat(list(c), add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   template_kwargs=chat_template_kwargs)
               for c in conversations]
        return self.generate(ids, params, use_tqdm=use_tqdm)

    @staticmethod
    def _result(req, text: str, logprobs: list, prompt_logprobs: list | None,
                stop_reason: int | str | None) -> CompletionOutput:
        lat = request_latency(req.arrival_time, req.token_times, req.first_scheduled_time)
        return CompletionOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            text,
            req.finish_reason,
            req.error,
            lat,
            logprobs,
            req.num_cached_tokens,
            prompt_logprobs,
            stop_reason,
        )


def _prompt(p) -> str | list[int]:
    """A prompt as text or token ids (vLLM's dict prompts: their text or ids)."""
    if not isinstance(p, dict):
        return p if isinstance(p, str) else list(p)
    if ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError(f"a dict prompt has either 'prompt' or 'prompt_token_ids': {p!r}")
    return p["prompt"] if "prompt" in p else list(p["prompt_token_ids"])


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
