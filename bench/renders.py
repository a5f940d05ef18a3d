"""The OpenAI door's tokenizer stage per request: a conversation rendered and encoded whole, against
daemon/renders.py continuing the last request's ids.

Run: .venv/bin/python bench/renders.py [--messages 240] [--requests 40] [--template FILE] [--against REV]

In process, no daemon: builtin:tiny's tokenizer (a Qwen2-style byte-level BPE, 1.7k tokens), its own
chat template or --template (a .jinja file, e.g. tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja). A
conversation of --messages messages (~4.9k tokens at 240) grows by an answer and a question per request,
--requests times; each request is timed whole (`prompt.conversation_ids`: render, then encode) and through
one `Renders` (as the door calls it), checked equal. Also timed apart: the whole render alone (what
every request now pays for its check) and the encode alone. --against REV also times daemon/renders.py
as it was at git revision REV (its module loaded from `git show`), for a before/after on one machine.
Medians and the range of the middle 80%, in ms; the machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.utils import load_tokenizer  # noqa: E402

from daemon.doors.placement import Said, links  # noqa: E402
from daemon.models.builtin import ensure_builtin  # noqa: E402
from daemon.prompt import conversation_ids, render  # noqa: E402
from daemon.renders import Renders  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _old_renders(rev: str) -> Any:
    """daemon/renders.py at `rev`, loaded as a module of the `daemon` package (its relative imports work)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:daemon/renders.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "renders_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("daemon.renders_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Renders


def _conversation(messages: int) -> list[Said]:
    convo = [Said("user", "Tell me how a KV cache is kept across restarts. " * 4)]
    for i in range(messages // 2):
        convo += [Said("assistant", f"Answer {i}: it is written behind each turn."),
                  Said("user", f"Question {i}?")]
    return convo[:messages]


def _ms(samples: list[float]) -> str:
    s = sorted(samples)
    lo, hi = s[len(s) // 10], s[(len(s) * 9) // 10 - 1 if len(s) >= 10 else -1]
    return f"{statistics.median(s) * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f})"


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=240)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--template", type=Path)
    ap.add_argument("--against", metavar="REV")
    args = ap.parse_args()
    tok = load_tokenizer(ensure_builtin("builtin:tiny", Path(tempfile.mkdtemp()) / "models"))
    if args.template is not None:
        tok.chat_template = args.template.read_text(encoding="utf-8")
    kinds: dict[str, Any] = {"renders.py now": Renders}
    if args.against:
        kinds[f"renders.py at {args.against}"] = _old_renders(args.against)
    convo = _conversation(args.messages - args.requests)  # --messages in the middle of the run
    times: dict[str, list[float]] = {k: [] for k in ["whole", "render alone", "encode alone", *kinds]}
    remembered = {name: cls() for name, cls in kinds.items()}
    for r in remembered.values():
        r.ids(tok, convo, None, None, links(None, convo))
    tokens = 0
    for i in range(args.requests):
        convo = [*convo, Said("assistant", f"Reply {i}: short, as asked."), Said("user", f"Next question {i}?")]
        templated = [m.for_template() for m in convo]
        chain = links(None, convo)
        took, want = _timed(conversation_ids, tok, templated, None)
        times["whole"].append(took)
        took, text = _timed(render, tok, templated, None)
        times["render alone"].append(took)
        times["encode alone"].append(_timed(functools.partial(tok.encode, add_special_tokens=False), text)[0])
        for name, r in remembered.items():
            took, got = _timed(r.ids, tok, convo, None, None, chain)
            assert got == want, name
            times[name].append(took)
        tokens = len(want)
    print(f"{args.requests} requests, {len(convo)} messages, {tokens} tokens at the last; template "
          f"{args.template or 'builtin:tiny'}; load {os.getloadavg()[0]:.1f}")
    for name, samples in times.items():
        print(f"  {name:28s} {_ms(samples)} ms")
    for name, r in remembered.items():
        print(f"  {name}: {r.appended} continued, {r.whole} whole (the first included)")


if __name__ == "__main__":
    main()
