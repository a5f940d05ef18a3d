"""What holding an answer to a JSON schema costs per token (issue 24), on the real default model.

    .venv/bin/python bench/jsonoutput.py [--model DIR] [--steps 40]

In one process, on the converted default model (`make serve` converts it once):

- view: building llguidance's view of the tokenizer (once per model, at the first JSON request);
- mask: per answer token, what the engine adds to a constrained sequence's step
  (`Constraint.take` of the token just fed, then `Constraint.mask` of the logits:
  llguidance's bitmask, unpacked and applied with `mx.where`), fed a real answer's tokens;
- step: one decode step of the model (a 1-token forward over a ~100-token cache),
  what a token costs without any constraint.

Medians over the answer's tokens and `--steps` forwards; the mask cost is paid by the
constrained sequence's row only, the other rows of a batch never call it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from daemon.doors.jsonoutput import output_grammar  # noqa: E402
from daemon.doors.openai_schema import ResponseFormat  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "capital": {"type": "string"}, "population_millions": {"type": "number"},
    "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "capital", "population_millions", "languages"], "additionalProperties": False}
ANSWER = '{\n  "name": "France",\n  "capital": "Paris",\n  "population_millions": 68.4,\n  "languages": ["French"]\n}'


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from daemon.engine.grammar import Constraint, tokenizer_view
    from daemon.engine.modelload import load_model
    from protocol import default_data_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an mlx-lm model directory (default: the converted default model)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    if args.model is None:
        from daemon.models.sources import prepare_model

        args.model = prepare_model("builtin:smollm2", default_data_dir() / "models")
    loaded = load_model("bench", args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    cache = make_prompt_cache(model)
    prompt = tokenizer.encode("Give me France as JSON. " * 8)[:100]
    width = model(mx.array([prompt]), cache=cache).shape[-1]
    mx.eval([c.state for c in cache])

    t0 = time.perf_counter()
    view = tokenizer_view(tokenizer, width)
    view_ms = (time.perf_counter() - t0) * 1000
    grammar = anyio.run(output_grammar, ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "country", "schema": SCHEMA, "strict": True}}))
    assert grammar is not None
    constraint = Constraint(view, grammar, width)
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    logits = mx.zeros((1, width))
    masks = []
    for i, token in enumerate(answer):
        t0 = time.perf_counter()
        if i:
            constraint.take(answer[i - 1])
        out = constraint.mask(logits)
        mx.eval(out)
        masks.append((time.perf_counter() - t0) * 1000)
        assert bool(out[0, token] == 0), f"the mask refused the answer's token {i} ({tokenizer.decode([token])!r})"
    constraint.take(answer[-1])
    assert constraint.accepting()

    steps = []
    token = mx.array([[answer[0]]])
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = model(token, cache=cache)
        mx.eval(out)
        steps.append((time.perf_counter() - t0) * 1000)
    mask_ms, step_ms = statistics.median(masks), statistics.median(steps)
    print(f"model {args.model.name}, vocabulary {width}, answer {len(answer)} tokens")
    print(f"| view (once per model) | {view_ms:.0f} ms |")
    print(f"| mask per token, median (max) | {mask_ms:.2f} ms ({max(masks):.2f}) |")
    print(f"| decode step, median | {step_ms:.1f} ms |")
    print(f"| mask / step | {mask_ms / step_ms:.1%} |")


if __name__ == "__main__":
    main()
