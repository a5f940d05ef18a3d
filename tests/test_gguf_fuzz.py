"""Hostile GGUF files: each stops `kvd serve` with one `kvd: error:` line, exit 1, no traceback, little memory.

The corpus is made here: small valid files written with gguf-py's writer
(tests/ggufmake.py), then edited byte by byte where the header says how much
follows (counts, lengths, dimensions, nesting) or changed in their metadata
(head counts, block counts, tokens, a chat template that fails). Peak memory
is the daemon's own: `ru_maxrss` survives exec, so a child forked straight
from pytest would report pytest's peak (378 MB late in a full run); a small
launcher, itself freshly exec'd, forks the daemon and reports its peak.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf import GGUFValueType as T

from ggufmake import write_llama

MAX_RSS_MB = 200

# argv: fd to report on, then the daemon's command; exits with the daemon's status
_LAUNCH = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(int(sys.argv[1]), str(usage.ru_maxrss).encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""

_HEADER = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata count


def _tiny(path: Path) -> Path:
    """The smallest file the edits below start from: two metadata entries and one tensor."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _patch(path: Path, at: int, fmt: str, value: int) -> Path:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


def _first_kv(path: Path) -> int:
    return _HEADER  # the first metadata key's length


def _tensor_info(path: Path) -> int:
    """Where the one tensor's info starts: after every metadata entry (the tiny file's are known)."""
    data = path.read_bytes()
    pos = _HEADER
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype == 8:  # string
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
        else:
            pos += {4: 4, 5: 4, 6: 4, 10: 8, 0: 1}[vtype]
    return pos


def _raw(path: Path, body: bytes) -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + body)
    return path


def _with_meta(path: Path, key: str, value: object, kind: GGUFValueType,
               sub: GGUFValueType | None = None, *, drop: bool = False) -> Path:
    """A whole small llama file (tests/ggufmake.py) whose metadata `key` is replaced by `value` (or dropped)."""
    write_llama(path, "F32")
    reader = GGUFReader(str(path))
    w = GGUFWriter(str(path) + ".new", "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        w.add_key_value(name, field.contents(), field.types[0],
                        sub_type=field.types[-1] if len(field.types) > 1 else None)
    if not drop:
        w.add_key_value(key, value, kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=tuple(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".new", path)
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _dev_zero(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


CASES: dict[str, Callable[[Path], Path]] = {
    # The header lies about how much follows.
    "n_dims 2^32-1": lambda p: _patch(_tiny(p), _tensor_info(p) + 8 + len("token_embd.weight"), "<I", 2**32 - 1),
    "key length 2^63": lambda p: _patch(_tiny(p), _first_kv(p), "<Q", 2**63),
    "key length 2^64-1": lambda p: _patch(_tiny(p), _first_kv(p), "<Q", 2**64 - 1),
    "metadata count 2^64-1": lambda p: _patch(_tiny(p), 16, "<Q", 2**64 - 1),
    "tensor count 2^40": lambda p: _patch(_tiny(p), 8, "<Q", 2**40),
    "array count 2^64-1": lambda p: _raw(p, struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"a"
                                         + struct.pack("<IIQ", 9, 4, 2**64 - 1)),
    "arrays nested 20,000 deep": lambda p: _raw(p, struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"a"
                                                + struct.pack("<IIQ", 9, 9, 1) * 20000 + b"\0" * 16),
    "the 100-byte file": lambda p: _raw(p, (struct.pack("<QQ", 1, 0) + struct.pack("<Q", 1) + b"t"
                                            + struct.pack("<I", 2**32 - 1)).ljust(92, b"\0")),
    "alignment a string": lambda p: _with_meta(p, "general.alignment", "32", T.STRING),
    "alignment NaN": lambda p: _with_meta(p, "general.alignment", float("nan"), T.FLOAT32),
    "alignment 3": lambda p: _with_meta(p, "general.alignment", 3, T.UINT32),
    "alignment an array": lambda p: _with_meta(p, "general.alignment", [32], T.ARRAY, T.UINT32),
    # The metadata describes no model kvd can build.
    "head_count 0": lambda p: _with_meta(p, "llama.attention.head_count", 0, T.UINT32),
    "head_count a string": lambda p: _with_meta(p, "llama.attention.head_count", "4", T.STRING),
    "head_count 3": lambda p: _with_meta(p, "llama.attention.head_count", 3, T.UINT32),
    "block_count 100000": lambda p: _with_meta(p, "llama.block_count", 100000, T.UINT32),
    "rms_eps a string": lambda p: _with_meta(p, "llama.attention.layer_norm_rms_epsilon", "1e-5", T.STRING),
    "tokens missing": lambda p: _with_meta(p, "tokenizer.ggml.tokens", None, T.ARRAY, drop=True),
    "tokens ints": lambda p: _with_meta(p, "tokenizer.ggml.tokens", list(range(300)), T.ARRAY, T.INT32),
    "bad merges": lambda p: _with_meta(p, "tokenizer.ggml.merges", ["nospace", "a b c"], T.ARRAY, T.STRING),
    "template {% for %}": lambda p: _with_meta(p, "tokenizer.chat_template", "{% for %}", T.STRING),
    "template raise_exception": lambda p: _with_meta(p, "tokenizer.chat_template",
                                                     "{{ raise_exception('no chats here') }}", T.STRING),
    # Not files at all.
    "a FIFO named x.gguf": _fifo,
    "a symlink to /dev/zero": _dev_zero,
}


# What the line must say, where the case has one obvious answer.
SAYS = {
    "a FIFO named x.gguf": "is a FIFO (named pipe), not a GGUF file",
    "a symlink to /dev/zero": "is a character device (it points to /dev/zero)",
    "the 100-byte file": "claims 4294967295 dimensions",
    "n_dims 2^32-1": "claims 4294967295 dimensions",
    "block_count 100000": "llama.block_count",
    "head_count 0": "llama.attention.head_count",
    "alignment 3": "general.alignment",
    "template {% for %}": "chat template fails on a sample conversation",
    "template raise_exception": "chat template fails on a sample conversation (no chats here)",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_gguf_file_is_one_line_and_little_memory(tmp_path: Path, case: str) -> None:
    model = CASES[case](tmp_path / "x.gguf")
    report_r, report_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, str(report_w), sys.executable, "-m", "daemon.cli", "serve",
         "--port", "0", "--model", str(model), "--data-dir", str(tmp_path / "kvd")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        pass_fds=(report_w,), start_new_session=True,
    )
    os.close(report_w)
    assert proc.stderr is not None
    # a hang is a failure, not a stuck suite: the whole group, launcher and daemon
    deadline = threading.Timer(180, os.killpg, (proc.pid, 9))
    deadline.start()
    err = proc.stderr.read()
    status = proc.wait()
    deadline.cancel()
    with os.fdopen(report_r, "rb") as report:
        peak_mb = int(report.read() or 0) / 1024
    errors = [line for line in err.splitlines() if line.startswith("kvd: error: ")]
    assert status == 1, (case, err)
    assert len(errors) == 1, (case, err)
    assert "Traceback" not in err, (case, err)
    assert 0 < peak_mb < MAX_RSS_MB, (case, peak_mb)
    if case in SAYS:
        assert SAYS[case] in errors[0], (case, errors[0])
