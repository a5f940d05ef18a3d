"""The model onto the engine thread: loaded in the dtype the device runs fastest, then warmed up.

Called on the engine thread only (the arrays it makes belong there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import heap

log = logging.getLogger("kvd.engine")

WARM_UP_TOKENS = 16  # a short turn's prefill, then one decode step


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    config: dict[str, Any]  # the model's config.json
    dtype: str  # its weights' dtype as run
    max_context: int | None  # its context length, if it says
    device: str = ""  # the device line: where it runs, in what dtype, whose attention (device.py)


def load_model(name: str, path: Path) -> Loaded:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from ..device import current
    from . import attention

    policy = current()  # described before the weights take the device's memory (Policy.budgets)
    t0 = time.perf_counter()
    model, tokenizer, model_config = load(str(path), return_config=True)  # type: ignore[misc]
    if policy.weights_dtype is not None:
        # On the CPU backend float32 matmuls are ~20x faster than bf16/fp16; a GPU runs the checkpoint's own.
        model.set_dtype(getattr(mx, policy.weights_dtype))
    check_template(tokenizer)
    # kvd's attention on the CPU backend, in every mlx-lm model (a GPU keeps MLX's fused kernel).
    attention.install(policy.kvd_attention)
    params: Any = tree_flatten(model.parameters())
    args = getattr(model, "args", None)
    device_line = policy.line(weights_label(params, model_config))
    log.info("loaded %s (%s) in %.1f s; %s", name, getattr(args, "model_type", "?"),
             time.perf_counter() - t0, device_line)
    if supplied := (model_config.get("kvd_gguf") or {}).get("chat_template_supplied"):
        log.info("the model file has no chat template (a base model); kvd supplied %s", supplied)
    return Loaded(model, tokenizer, model_config, dtype=str(params[0][1].dtype),
                  max_context=int(getattr(args, "max_position_embeddings", 0) or 0) or None, device=device_line)


def weights_label(params: Any, model_config: dict[str, Any]) -> str:
    """What the weights run as, in a word: "4-bit" for a quantized model, else the floats' dtype."""
    bits = (model_config.get("quantization") or {}).get("bits")
    if isinstance(bits, int):
        return f"{bits}-bit"
    floats = [str(v.dtype) for _, v in params if "float" in str(v.dtype)]
    return (floats[0] if floats else str(params[0][1].dtype)).removeprefix("mlx.core.")


class TemplateError(Exception):
    """The model's chat template fails on an ordinary conversation: every turn would fail the same way."""


# No system message: some templates (Mistral's) refuse one, and work for every conversation without.
SAMPLE = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."},
          {"role": "user", "content": "And now?"}]


def check_template(tokenizer: Any) -> None:
    """Render the chat template once, at load, so a broken one stops kvd with one line, not every request."""
    try:
        tokenizer.apply_chat_template(SAMPLE, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template is code: any error it raises is its own
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TemplateError(f"its chat template fails on a sample conversation ({first[:200]}); fix "
                            "tokenizer.chat_template in the model, or use another model") from None


def warm_up(model: Any, tokenizer: Any, cache: list[Any], tokens: tuple[int, ...] = (WARM_UP_TOKENS,), *,
            draw: Callable[[Any], Any] | None = None) -> float:
    """Run short prefills and one decode step on a throwaway cache; the milliseconds it took.

    MLX's first forward after a load pays for allocating its buffers and
    waking the BLAS threads: measured on SmolLM2-135M, a 13-token turn
    over a 2k context took 687 ms as the first forward and 480 ms after.
    That cost belongs to start-up (before `ready`), not to the first user's turn.
    `draw`: a token drawn as a turn with the configured sampling draws it
    (Draws.take), from the prefill's last logits: on the CPU, MLX compiles
    each fused kernel with g++ the first time it meets it (and keeps it under
    /tmp, so again after a reboot); with only the greedy argmax warmed up, the
    sampler's kernels cost the first sampled turn ~1 s.
    `tokens`: the prefills' lengths, the device policy's (daemon/device.py): on a
    GPU a whole prefill chunk first, whose kernels a long first turn needs.
    Then the heap's reserve is faulted in (engine/heap.py, where malloc is
    tuned: the CPU): a first turn's attention over a long cache allocates
    tens of MB that a fresh process has never touched, ~1.5 ms a MB here.
    """
    import mlx.core as mx

    t0 = time.perf_counter()
    ids = tokenizer.encode("Hello, who are you?") or [0]
    *chunks, last = [mx.array([(ids * (n // len(ids) + 1))[:n]]) for n in tokens]
    for chunk in chunks:  # as engine/prefill.py feeds a chunk that is not the prompt's last
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(last, cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    if draw is not None:
        lp = logits[:, -1, :]
        mx.eval(draw(lp - mx.logsumexp(lp, axis=-1, keepdims=True)))
    mx.eval(model(token[:, None], cache=cache))
    touched = heap.reserve()  # the first turn's buffers: pages faulted in now, not in that turn
    ms = (time.perf_counter() - t0) * 1000
    log.info("warmed up in %.0f ms (%s-token prefill%s and a decode step%s)", ms,
             " + ".join(str(n) for n in tokens), "s" if len(tokens) > 1 else "",
             f"; {touched >> 20} MiB of heap faulted in" if touched else "")
    return ms
