"""Several models loading at once in a real `kvd serve`, under traffic (issue 51).

The red team's shape: a daemon starts on the default model and at once gets two
requests each for three models (the default, still loading, and two more it
loads on first use). On MLX 0.32 that crashed kvd with SIGSEGV in libmlx in 2
of 7 tries and failed the load of a model that loads fine alone in the other 5
("There is no Stream(cpu, 0) in current thread"), with nothing in the log but
that line: kvd's attention kept its causal masks in one dict for every thread,
so one engine thread evaluated (or two at once evaluated) a lazy array another
had made (daemon/engine/attention.py). Each of those 7 tries went wrong one way
or the other, so six starts here (not twenty: each is a start of three models,
about 30 s on a busy 2-core machine): kvd never dies, every request is answered
or refused in one clear line, and a load that fails leaves its exception and
traceback in the log.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from openai.types.chat import ChatCompletionMessageParam

from daemonproc import DaemonProcess

ROUNDS = 6
DEFAULT = "builtin:smollm2"
MODELS = (DEFAULT, "builtin:tiny", "builtin:tiny-swa")


def ask(d: DaemonProcess, model: str, n: int) -> str:
    """One request, as a client would send it: the answer's text, or the refusal's one line
    (a refusal must be an HTTP error with a message; a dropped connection fails the test)."""
    client = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0, timeout=300)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"Hello {n}?"}]
    try:
        if n % 2:  # streamed, as coding agents ask
            chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        return str(answer.choices[0].message.content)
    except openai.APIStatusError as e:
        message = e.response.json()["error"]["message"]
        assert e.status_code in (429, 503) and "\n" not in message and model in message, (e.status_code, message)
        return f"refused: {message}"


def failures_logged_with_their_cause(log: str) -> list[str]:
    """Each load failure the log tells (the registry's one line), and whether a traceback names that model."""
    failed = sorted(set(re.findall(r"the model (\S+) failed to load", log)))
    return [m for m in failed if not re.search(rf"loading model {re.escape(m)} failed\nTraceback", log)]


def test_three_models_loading_at_once_under_traffic_never_crash_kvd(tmp_path: Path, smollm2: Path) -> None:
    refused = []
    for n in range(ROUNDS):
        data = tmp_path / f"round{n}"
        data.mkdir()
        (data / "models").symlink_to(smollm2)  # the default fetched and converted once, by the fixture
        d = DaemonProcess(data, "--model", DEFAULT)  # listening; the default is still loading
        try:
            with ThreadPoolExecutor(2 * len(MODELS)) as pool:
                said = list(pool.map(ask, [d] * 2 * len(MODELS), [m for m in MODELS for _ in (0, 1)], range(6)))
            assert d.proc.poll() is None, f"round {n}: kvd died ({d.proc.returncode}):\n" + "".join(d.log[-20:])
            refused += [s for s in said if s.startswith("refused")]
        finally:
            stopped = d.terminate()
        assert stopped == 0, "".join(d.log[-20:])
        log = (data / "kvd.log").read_text()
        assert not failures_logged_with_their_cause(log), log
    assert not refused, refused  # each of these models loads alone, so with loads made safe none is refused


def test_a_model_that_fails_to_load_logs_its_cause_and_tells_the_client_one_line(tmp_path: Path) -> None:
    """Weights cut in half: the header is whole (the footprint reads), the load fails on the engine thread."""
    from daemon.models.builtin import ensure_builtin

    data = tmp_path / "data"
    weights = ensure_builtin("builtin:tiny-swa", data / "models") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    d = DaemonProcess(data)  # on builtin:tiny
    try:
        said = ask(d, "builtin:tiny-swa", 0)
        assert said.startswith("refused: the model builtin:tiny-swa failed to load: "), said
        assert ask(d, "builtin:tiny", 2) and d.proc.poll() is None  # the daemon serves on
    finally:
        stopped = d.terminate()
    assert stopped == 0
    log = (data / "kvd.log").read_text()
    assert re.search(r"ERROR kvd.models: loading model builtin:tiny-swa failed\nTraceback \(most recent call "
                     r"last\):\n(.*\n)*.*thread.py.*in load\n", log), log
    assert not failures_logged_with_their_cause(log)
