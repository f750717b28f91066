"""Reliability audit: bad inputs, broken files, plugins and faults, each classified.

    python benchmarks/reliability_audit.py            # every case, a table of counts
    python benchmarks/reliability_audit.py --list     # one line per case as well
    python benchmarks/reliability_audit.py --group run --json audit.json

Every case runs against tiny random models saved to a temporary folder (a Qwen3 target with the demo
pair's tokenizer and a one-layer DFlash drafter). Each is classified as

- **correct**: a valid input decoded as it should (greedy output equals the target's own greedy tokens,
  files left as they were, a resume equal to a clean run...);
- **clear error**: a bad input refused with a ``BastionError`` whose first line names the cause (the
  field, file, tensor, component), or on the command line exit code 2 with one ``error:`` line naming it
  and no traceback;
- **unclear error**: refused, but with another exception type, exit code 1, or a message that does not
  name the cause (or a valid input refused);
- **silently wrong**: a bad input accepted, wrong output, or a file damaged;
- **crash**: a traceback out of the command line, a case past its time limit or memory bound.

Command-line cases run in this process through ``bastion.cli.main.main`` (stdout and stderr captured);
the few that need separate processes (a second run on a locked output, SIGKILL and resume, the real exit
code) run as subprocesses with a time limit. Exit status: 0 when every case is correct or a clear error.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import attrs

CORRECT, CLEAR, UNCLEAR, WRONG, CRASH = "correct", "clear error", "unclear error", "silently wrong", "crash"
CLASSES = (CORRECT, CLEAR, UNCLEAR, WRONG, CRASH)
REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 7, 8]
#: a case's peak memory may grow by this much at most
MEMORY_BOUND = 2 * 1024**3


@attrs.frozen
class CliResult:
    code: int
    out: str
    err: str


@attrs.frozen
class Case:
    """One audited input. ``ok`` checks what a successful call returned (None: the input is bad and must
    be refused); ``names`` are the words of which the error's first line must hold one; ``after`` must
    hold whatever happened (no file damaged); ``cli``: ``call`` returns a :class:`CliResult`."""

    group: str
    name: str
    call: Callable[[], Any]
    ok: Callable[[Any], bool] | None = None
    names: tuple[str, ...] = ()
    after: Callable[[], bool] | None = None
    cli: bool = False
    timeout: float = 90.0


@attrs.frozen
class Outcome:
    case: Case
    kind: str
    detail: str
    seconds: float


# ------------------------------------------------------------------------------------------ running cases
class _Timeout(BaseException):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def _named(line: str, names: Sequence[str]) -> bool:
    return not names or any(n.lower() in line.lower() for n in names)


def classify(case: Case) -> Outcome:
    from bastion.contract.errors import BastionError

    start, rss = time.perf_counter(), _peak_rss()
    try:
        with _time_limit(case.timeout), warnings_off():
            value = case.call()
    except _Timeout:
        return Outcome(case, CRASH, f"still running after {case.timeout:.0f}s", time.perf_counter() - start)
    except MemoryError as exc:
        return Outcome(case, CRASH, f"MemoryError: {exc}", time.perf_counter() - start)
    except BastionError as exc:
        kind, detail = _error_kind(case, type(exc).__name__, str(exc))
        return _finish(case, kind, detail, start, rss)
    except SystemExit as exc:  # only the command line exits, and main() returns its code instead
        return _finish(case, CRASH, f"SystemExit({exc.code}) escaped", start, rss)
    except Exception as exc:  # noqa: BLE001 - what escaped is what the audit reports
        detail = f"{type(exc).__name__}: {_first_line(str(exc))}"
        if case.cli:
            return _finish(case, CRASH, f"traceback out of the command line: {detail}", start, rss)
        return _finish(case, UNCLEAR, detail, start, rss)
    if case.cli:
        return _finish(case, *_cli_kind(case, value), start, rss)
    if case.ok is None:
        return _finish(case, WRONG, f"accepted, returned {_short(value)}", start, rss)
    try:
        good = case.ok(value)
    except Exception as exc:  # noqa: BLE001
        good, value = False, f"check failed: {type(exc).__name__}: {exc}"
    return _finish(case, CORRECT if good else WRONG, "" if good else f"wrong result: {_short(value)}", start, rss)


def _error_kind(case: Case, type_name: str, message: str) -> tuple[str, str]:
    first = _first_line(message)
    detail = f"{type_name}: {first}"
    if case.ok is not None and not case.names:
        return UNCLEAR, f"a valid input refused: {detail}"
    if not _named(first, case.names):
        return UNCLEAR, f"does not name {'/'.join(case.names)}: {detail}"
    return CLEAR, detail


def _cli_kind(case: Case, res: CliResult) -> tuple[str, str]:
    if "Traceback" in res.err:
        return CRASH, "traceback: " + _first_line(res.err.split("Traceback", 1)[1])
    errors = [line for line in res.err.splitlines() if "error:" in line]
    if res.code == 0:
        if case.ok is None:
            return WRONG, "exit 0 on a bad input"
        good = case.ok(res)
        return (CORRECT, "") if good else (WRONG, "exit 0, wrong result")
    if res.code == 2:
        if len(errors) != 1:
            return UNCLEAR, f"exit 2 with {len(errors)} error lines: {' | '.join(errors)[:160]}"
        return _error_kind(case, "exit 2", errors[0])
    if res.code == 1:
        return UNCLEAR, f"exit 1: {errors[0] if errors else _first_line(res.err)}"
    return CRASH, f"exit {res.code}: {_first_line(res.err)}"


def _finish(case: Case, kind: str, detail: str, start: float, rss: float) -> Outcome:
    grown = _peak_rss() - rss
    if grown > MEMORY_BOUND:
        kind, detail = CRASH, f"peak memory grew by {grown / 1024**3:.1f} GB ({detail})"
    if case.after is not None:
        try:
            intact = case.after()
        except Exception as exc:  # noqa: BLE001
            intact, detail = False, f"{detail}; after-check failed: {exc}"
        if not intact and kind in (CORRECT, CLEAR, UNCLEAR):
            kind, detail = WRONG, f"a file was changed ({detail or kind})"
    return Outcome(case, kind, detail, time.perf_counter() - start)


@contextlib.contextmanager
def warnings_off() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


# ------------------------------------------------------------------------------------------ the world
class World:
    """The tiny models and files every case uses, built once."""

    def __init__(self, root: Path) -> None:
        import torch

        from bastion.testing.tiny import save_tiny_pair

        torch.set_num_threads(1)
        self.root = root
        self.pair = save_tiny_pair(root / "pair", max_positions=128)
        self._n = 0

    def tmp(self, name: str = "case") -> Path:
        self._n += 1
        path = self.root / f"{name}-{self._n}"
        path.mkdir()
        return path

    @functools.cached_property
    def pipe(self) -> Any:
        import bastion

        return bastion.Pipeline.from_pretrained(self.pair.target, str(self.pair.drafter), max_nodes=16)

    @property
    def vocab(self) -> int:
        return int(self.pipe.target.vocab_size)

    @functools.lru_cache(maxsize=None)
    def reference(self, prompt: tuple[int, ...], n: int) -> list[int]:
        import torch

        from bastion.testing.reference import greedy_reference

        return greedy_reference(self.pipe.target.model, torch.tensor([list(prompt)]), n)

    def greedy(self, prompt: Sequence[int], n: int) -> Callable[[Any], bool]:
        def check(result: Any) -> bool:
            return list(result.tokens) == self.reference(tuple(prompt), n)[: len(result.tokens)] and len(result.tokens) > 0

        return check

    @functools.cached_property
    def hf(self) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(self.pair.target), dtype="float32").eval()
        return model, AutoTokenizer.from_pretrained(str(self.pair.target))

    def prompts(self, n: int = 3, name: str = "in.jsonl", rows: Sequence[dict[str, Any]] | None = None) -> Path:
        path = self.tmp("prompts") / name
        rows = rows if rows is not None else [{"id": i, "prompt": f"Question {i}?"} for i in range(n)]
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        return path

    def run_args(self, inp: Path | str, out: Path | str, *extra: str) -> list[str]:
        return ["run", "--input", str(inp), "--output", str(out), "--target", str(self.pair.target), "--drafter",
                str(self.pair.drafter), "--max-new-tokens", "4", "--batch-size", "4", "--device", "cpu", "--threads", "1",
                "--no-progress", *extra]  # fmt: skip

    def gen_args(self, *extra: str) -> list[str]:
        return ["generate", "--target", str(self.pair.target), "--drafter", str(self.pair.drafter), "--device", "cpu",
                "--max-new-tokens", "4", *extra]  # fmt: skip


def cli(argv: list[str], stdin: str | None = None) -> CliResult:
    """``bastion ARGV`` in this process: its exit code and what it printed."""
    from bastion.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's own exits (--help, usage errors)
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        sys.stdin = old_stdin
    return CliResult(int(code), out.getvalue(), err.getvalue())


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
            "BASTION_NO_DEVICE_PROBE": "1"}  # fmt: skip


def subprocess_cli(argv: list[str], timeout: float = 120.0) -> CliResult:
    """``python -m bastion ARGV`` in a new process, killed after ``timeout`` seconds (a crash)."""
    try:
        done = subprocess.run([sys.executable, "-m", "bastion", *argv], env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise _Timeout() from None
    return CliResult(done.returncode, done.stdout, done.stderr)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def _unchanged(path: Path) -> Callable[[], bool]:
    before = path.read_bytes() if path.is_file() else None
    return lambda: (path.read_bytes() if path.is_file() else None) == before


# ------------------------------------------------------------------------------------------ inputs, every path
#: bad values of each generation setting (the same on every path)
BAD_SETTINGS: dict[str, list[Any]] = {
    "seed": [-1, 2**64, 1.5, True, "7"],
    "temperature": [-1.0, float("nan"), float("inf"), 1e-9, "0.5", True],
    "top_p": [0.0, 1.5, float("nan"), "x"],
    "top_k": [-1, 2.5, True],
    "max_new_tokens": [0, -1, 2.5, True, None, "4"],
    "stop": ["", [""], [1], 5],
    "stop_on_eos": ["no", 1, None],
}


def _spellings(name: str) -> tuple[str, ...]:
    return (name, name.replace("_", "-"))


def setting_cases(w: World) -> list[Case]:
    """Every bad setting on every path: generate, stream, chat, generate_batch, decode_steps,
    GenerationConfig, the HF drop-in (its config), a bastion run row, and the command lines."""
    import bastion

    cases: list[Case] = []

    def kw(name: str, value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": 4, name: value}
        if name in ("seed", "top_p", "top_k"):
            out.setdefault("temperature", 1.0)
        return out

    for name, values in BAD_SETTINGS.items():
        names = _spellings(name)
        for value in values:
            label = f"{name}={value!r}"
            k = kw(name, value)
            cases += [
                Case("api", f"generate {label}", lambda k=k: w.pipe.generate(PROMPT, **k), names=names),
                Case("api", f"stream {label}", lambda k=k: "".join(w.pipe.stream(PROMPT, **k)), names=names),
                Case("api", f"chat {label}", lambda k=k: w.pipe.chat("Hello", **k), names=names),
                Case("api", f"generate_batch {label}", lambda k=k: w.pipe.generate_batch([PROMPT, PROMPT[:3]], **k), names=names),
                Case("api", f"GenerationConfig {label}", lambda k=k: _config(**k), names=names),
                Case("api", f"stream_batch {label}", lambda k=k: list(w.pipe.stream_batch([PROMPT, PROMPT[:3]], **k)), names=names),
            ]
            if name != "stop":
                cases.append(Case("api", f"decode_steps {label}", lambda k=k: _drain(w.pipe.decode_steps(PROMPT, **k)), names=names))
            cases.append(Case("hf", f"speculative(config=...) {label}", lambda k=k: _hf_generate(w, config=k), names=names))
            if name != "stop_on_eos" and value is not None:
                cases.append(Case("run", f"row {label}", lambda n=name, v=value: _run_row(w, {"prompt": "Hi", n: v}), names=names, cli=True))
    # the command lines: the same values as text
    cli_values = {
        "seed": ["-1", "18446744073709551616", "1.5"],
        "temperature": ["-1", "nan", "inf", "1e-9"],
        "top_p": ["0", "1.5", "nan"],
        "top_k": ["-1", "2.5"],
        "max_new_tokens": ["0", "-1", "2.5"],
    }
    for name, values in cli_values.items():
        flag = "--" + name.replace("_", "-")
        for value in values:
            extra = [f"{flag}={value}"] + (["--temperature=1"] if name in ("seed", "top_p", "top_k") else [])
            cases.append(Case("cli", f"generate {flag} {value}", lambda e=extra: cli(w.gen_args("--prompt", "Hi", *e)),
                              names=_spellings(name), cli=True))
            cases.append(Case("cli", f"generate (batch) {flag} {value}",
                              lambda e=extra: cli(w.gen_args("--prompt", "Hi", "--prompt", "Yo", *e)), names=_spellings(name), cli=True))
            cases.append(Case("run", f"run {flag} {value}", lambda e=extra: _run_cli(w, *e), names=_spellings(name), cli=True))
            cases.append(Case("cli", f"bench {flag} {value}", lambda e=extra: _bench(w, *e), names=_spellings(name), cli=True))
    cases.append(Case("cli", "generate --stop ''", lambda: cli(w.gen_args("--prompt", "Hi", "--stop=")), names=("stop",), cli=True))
    cases.append(Case("run", "run --batch-size 0", lambda: _run_cli(w, "--batch-size", "0"), names=_spellings("batch_size"), cli=True))
    cases.append(Case("run", "run --threads 0", lambda: _run_cli(w, "--threads", "0"), names=("threads",), cli=True))
    cases.append(Case("run", "run --threads -2", lambda: _run_cli(w, "--threads", "-2"), names=("threads",), cli=True))
    cases.append(Case("cli", "generate --threads 0", lambda: cli(w.gen_args("--prompt", "Hi", "--threads", "0")), names=("threads",), cli=True))
    cases.append(Case("cli", "bench --threads -2", lambda: _bench(w, "--threads", "-2"), names=("threads",), cli=True))
    cases.append(Case("cli", "bench --warmup-tokens -1", lambda: _bench(w, "--warmup-tokens", "-1"), names=("warmup",), cli=True))
    cases.append(Case("cli", "bench --repeats 0", lambda: _bench(w, "--repeats", "0"), names=("repeats",), cli=True))
    cases.append(Case("cli", "bench --temperatures 0,-1", lambda: _bench(w, "--temperatures", "0,-1"), names=("temperature",), cli=True))

    # valid values at the edge are accepted everywhere
    top = 2**64 - 1
    cases += [
        Case("api", "generate seed=2**64-1", lambda: w.pipe.generate(PROMPT, 4, 1.0, top), ok=lambda r: len(r.tokens) == 4),
        Case("api", "generate_batch seed=2**64-1 (row 1 wraps to 0)",
             lambda: (w.pipe.generate_batch([PROMPT, PROMPT], 4, 1.0, top), w.pipe.generate(PROMPT, 4, 1.0, 0)),
             ok=lambda r: r[0][1].tokens == r[1].tokens),
        Case("api", "generate numpy ints", lambda: _numpy_settings(w), ok=lambda r: len(r.tokens) == 4),
        Case("run", "run --seed 2**64-1 --temperature 1", lambda: _run_cli(w, f"--seed={top}", "--temperature=1"),
             ok=lambda r: r.code == 0, cli=True),
        Case("cli", "generate --seed 2**64-1", lambda: cli(w.gen_args("--prompt", "Hi", f"--seed={top}", "--temperature=1")),
             ok=lambda r: r.code == 0, cli=True),
        Case("api", "GenerationConfig merge of an unknown setting", lambda: _config(max_new_tokens=4).merge(topp=0.5), names=("topp",)),
        Case("api", "generate config='x'", lambda: w.pipe.generate(PROMPT, config="x"), names=("config",)),
        Case("api", "SamplingParams mapping with a typo", lambda: bastion.GenerationConfig(sampling={"temprature": 1.0}),
             names=("temprature",)),
    ]
    return cases


def _config(**kw: Any) -> Any:
    from bastion.engine.params import generation_config

    return generation_config(None, **kw)


def _numpy_settings(w: World) -> Any:
    import numpy as np

    return w.pipe.generate(PROMPT, np.int64(4), np.float32(1.0), np.uint64(7), top_k=np.int32(5), top_p=np.float64(0.9))


def _drain(gen: Any) -> Any:
    keep = None
    while True:
        try:
            gen.send(keep)
        except StopIteration as done:
            return done.value


def _hf_generate(w: World, config: dict[str, Any] | None = None, **generate_kw: Any) -> Any:
    import torch

    import bastion.hf

    model, tok = w.hf
    gen = bastion.hf.speculative(str(w.pair.drafter), tokenizer=tok, config=None if config is None else _config(**config))
    inputs = torch.tensor([PROMPT])
    generate_kw.setdefault("max_new_tokens", 4)
    return model.generate(inputs, attention_mask=torch.ones_like(inputs), custom_generate=gen, **generate_kw)


def _run_row(w: World, row: dict[str, Any]) -> CliResult:
    folder = w.tmp("row")
    inp = folder / "in.jsonl"
    inp.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return cli(w.run_args(inp, folder / "out.jsonl"))


def _run_cli(w: World, *extra: str) -> CliResult:
    folder = w.tmp("run")
    return cli(w.run_args(w.prompts(2), folder / "out.jsonl", *extra))


def _bench(w: World, *extra: str) -> CliResult:
    folder = w.tmp("bench")
    data = folder / "data.jsonl"
    data.write_text(json.dumps({"question": "What is 2+3?", "answer": "5"}) + "\n", encoding="utf-8")
    return cli(["bench", "--target", str(w.pair.target), "--drafter", str(w.pair.drafter), "--device", "cpu",
                "--datasets", f"gsm8k={data}", "--limit", "1", "--max-new-tokens", "4", "--methods", "ar,bastion",
                "--repeats", "1", "--warmup-tokens", "0", "--no-plots", "--no-progress", "--out", str(folder / "out"), *extra])  # fmt: skip


# ------------------------------------------------------------------------------------------ prompts
def prompt_cases(w: World) -> list[Case]:
    import torch

    v = lambda: w.vocab  # noqa: E731
    bad: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = [
        ("[]", lambda: [], ("empty", "prompt")),
        ("[[]]", lambda: [[]], ("empty", "prompt", "token ids")),
        ("[1.5]", lambda: [1.5], ("token",)),
        ("[V+5]", lambda: [v() + 5], ("vocabulary", str(v()))),
        ("[-1]", lambda: [-1], ("[0,",)),
        ("None", lambda: None, ("prompt", "input_ids")),
        ("''", lambda: "", ("empty", "prompt")),
        ("messages without content", lambda: [{"role": "user"}], ("content", "messages")),
        ("content None", lambda: [{"role": "user", "content": None}], ("content", "messages")),
        ("content 5", lambda: [{"role": "user", "content": 5}], ("content", "messages")),
        ("role 5", lambda: [{"role": 5, "content": "hi"}], ("role", "messages")),
        ("float tensor", lambda: torch.zeros(1, 4), ("integer", "dtype")),
        ("3-D tensor", lambda: torch.ones(1, 2, 2, dtype=torch.long), ("shape", "input_ids", "[1, L]")),
        ("mask shape", lambda: {"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.tensor([[1]])}, ("attention_mask",)),
    ]
    cases: list[Case] = []
    for label, make, names in bad:
        cases.append(Case("api", f"generate prompt {label}", lambda m=make: w.pipe.generate(m(), 4), names=names))
        batch = (lambda m=make: m()) if label == "mask shape" else (lambda m=make: [PROMPT, m()])
        cases.append(Case("api", f"generate_batch prompt {label}", lambda b=batch: w.pipe.generate_batch(b(), 4), names=names))
        if label.startswith(("messages", "content", "role")):
            cases.append(Case("api", f"chat {label}", lambda m=make: w.pipe.chat(m(), 4), names=names))
    text_ids = lambda: w.pipe.encode("Hello there")[0].tolist()  # noqa: E731
    chat = [{"role": "user", "content": "Hello"}]
    cases += [
        Case("api", "generate ids", lambda: w.pipe.generate(PROMPT, 6), ok=w.greedy(PROMPT, 6)),
        Case("api", "generate text", lambda: (w.pipe.generate("Hello there", 6), text_ids()),
             ok=lambda r: w.greedy(r[1], 6)(r[0])),
        Case("api", "chat messages", lambda: (w.pipe.chat(chat, 6), w.pipe.encode_chat(chat)[0].tolist()),
             ok=lambda r: w.greedy(r[1], 6)(r[0])),
        Case("api", "generate_batch rows", lambda: w.pipe.generate_batch([PROMPT, PROMPT[:3]], 6),
             ok=lambda r: w.greedy(PROMPT, 6)(r[0]) and w.greedy(PROMPT[:3], 6)(r[1])),
        Case("api", "stream text joins to the result", lambda: _stream_text(w), ok=lambda r: r[0] == r[1]),
        Case("api", "decode_steps send(-5)", lambda: _send(w, -5), names=("send", "keep", "-5")),
        Case("api", "decode_steps send(1.5)", lambda: _send(w, 1.5), names=("send", "keep", "1.5")),
        Case("api", "decode_steps send('x')", lambda: _send(w, "x"), names=("send", "keep", "'x'")),
        Case("api", "decode_steps send(100), past the tokens yielded", lambda: _send(w, 100), names=("send", "k must")),
        Case("api", "decode_steps send(1) keeps one token", lambda: _send(w, 1), ok=lambda r: r[0] == r[1][: len(r[0])] and len(r[0]) >= 1),
        Case("api", "decode([V+5])", lambda: w.pipe.decode([w.vocab + 5]), names=("vocabulary", "token")),
        Case("api", "decode([-1])", lambda: w.pipe.decode([-1]), names=("vocabulary", "token")),
        Case("api", "decode(['a'])", lambda: w.pipe.decode(["a"]), names=("token",)),
        Case("api", "encode(5)", lambda: w.pipe.encode(5), names=("string", "str")),
        Case("api", "on_step='x'", lambda: w.pipe.generate(PROMPT, 4, on_step="x"), names=("on_step",)),
        Case("api", "caller's prompt tensor untouched", lambda: _prompt_untouched(w), ok=bool),
    ]
    # the command line and run: the same prompts
    folder = w.tmp("files")
    binary = folder / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 64)
    cases += [
        Case("cli", "generate --prompt ''", lambda: cli(w.gen_args("--prompt", "")), names=("prompt", "empty"), cli=True),
        Case("cli", "generate --prompt '   '", lambda: cli(w.gen_args("--prompt", "   ")), names=("prompt", "empty"), cli=True),
        Case("cli", "generate --prompt-file binary", lambda: cli(w.gen_args("--prompt-file", str(binary))), names=("binary.bin",), cli=True),
        Case("cli", "generate --prompt-file missing", lambda: cli(w.gen_args("--prompt-file", str(folder / "none.txt"))),
             names=("none.txt",), cli=True),
        Case("cli", "generate --prompt-file a folder", lambda: cli(w.gen_args("--prompt-file", str(folder))), names=(str(folder),), cli=True),
        Case("cli", "generate --prompt - from stdin", lambda: cli(w.gen_args("--prompt", "-"), stdin="Hello there"),
             ok=lambda r: r.code == 0, cli=True),
        Case("cli", "generate --json", lambda: cli(w.gen_args("--raw", "--prompt", "Hello there", "--json", "--max-new-tokens=6")),
             ok=lambda r: json.loads(r.out)["tokens"] == w.reference(tuple(text_ids()), 6)[: len(json.loads(r.out)["tokens"])], cli=True),
        Case("cli", "generate --max-nodes 100000 (capped at the positions)",
             lambda: cli(w.gen_args("--prompt", "Hi", "--max-nodes", "100000")), ok=lambda r: r.code == 0, cli=True),
        Case("cli", "generate --max-nodes 0", lambda: cli(w.gen_args("--prompt", "Hi", "--max-nodes", "0")), names=_spellings("max_nodes"), cli=True),
        Case("cli", "generate --device cuda", lambda: cli(w.gen_args("--prompt", "Hi", "--device", "cuda")), names=("cuda",), cli=True),
        Case("cli", "generate --device meta", lambda: cli(w.gen_args("--prompt", "Hi", "--device", "meta")), names=("meta",), cli=True),
        Case("cli", "generate --device gpu0", lambda: cli(w.gen_args("--prompt", "Hi", "--device", "gpu0")), names=("gpu0",), cli=True),
        Case("cli", "generate --dtype int8", lambda: cli(w.gen_args("--prompt", "Hi", "--dtype", "int8")), names=("dtype",), cli=True),
        Case("cli", "generate --target missing", lambda: cli(["generate", "--target", str(folder / "nope"), "--drafter",
                                                              str(w.pair.drafter), "--prompt", "Hi"]), names=("nope",), cli=True),
        Case("cli", "generate --drafter missing", lambda: cli(["generate", "--target", str(w.pair.target), "--drafter",
                                                               str(folder / "nodrafter"), "--prompt", "Hi"]), names=("nodrafter",), cli=True),
        Case("cli", "generate --unknown-option", lambda: cli(w.gen_args("--prompt", "Hi", "--temprature", "1")), names=("temprature",), cli=True),
        Case("cli", "generate --drafter-option typo", lambda: cli(w.gen_args("--prompt", "Hi", "--drafter-option", "blok_size=3")),
             names=("blok_size",), cli=True),
        Case("cli", "generate --tree-builder unknown", lambda: cli(w.gen_args("--prompt", "Hi", "--tree-builder", "nosuch")),
             names=("nosuch",), cli=True),
        Case("cli", "bench --datasets gsm8k=<binary>", lambda: _bench_data(w, binary), names=("binary.bin",), cli=True),
        Case("cli", "bench --datasets gsm8k=<missing>", lambda: _bench_data(w, folder / "none.jsonl"), names=("none.jsonl",), cli=True),
    ]
    return cases


def _bench_data(w: World, data: Path) -> CliResult:
    folder = w.tmp("bench")
    return cli(["bench", "--target", str(w.pair.target), "--drafter", str(w.pair.drafter), "--device", "cpu",
                "--datasets", f"gsm8k={data}", "--limit", "1", "--max-new-tokens", "4", "--methods", "ar",
                "--repeats", "1", "--no-plots", "--no-progress", "--out", str(folder / "out")])  # fmt: skip


def _stream_text(w: World) -> tuple[str, str]:
    stream = w.pipe.stream("Hello there", 8)
    text = "".join(stream)
    return text, stream.result.text


def _send(w: World, keep: Any) -> tuple[list[int], list[int]]:
    gen = w.pipe.decode_steps(PROMPT, 12, stop_on_eos=False)
    seen: list[int] = []
    tokens, _ = next(gen)
    seen += tokens
    tokens, _ = gen.send(None)
    seen += tokens
    try:
        gen.send(keep)
    except StopIteration as done:
        return list(done.value.tokens), seen
    gen.close()
    raise AssertionError("send(k) did not end the generation")


def _prompt_untouched(w: World) -> bool:
    import torch

    prompt = torch.tensor([PROMPT])
    w.pipe.generate(prompt, 4)
    return prompt.tolist() == [PROMPT]


# ------------------------------------------------------------------------------------------ the HF drop-in
def hf_cases(w: World) -> list[Case]:
    import bastion.hf

    def plain(n: int) -> list[int]:
        return w.reference(tuple(PROMPT), n)

    return [
        Case("hf", "greedy equals plain generate", lambda: _hf_generate(w, max_new_tokens=6),
             ok=lambda seq: seq[0, len(PROMPT):].tolist() == plain(6)),
        Case("hf", "sampling with top_k / top_p", lambda: _hf_generate(w, do_sample=True, top_k=5, top_p=0.9),
             ok=lambda seq: seq.shape[1] == len(PROMPT) + 4),
        Case("hf", "stop_strings=''", lambda: _hf_generate(w, stop_strings=""), names=("stop",)),
        Case("hf", "stop_strings=[5]", lambda: _hf_generate(w, stop_strings=[5]), names=("stop",)),
        Case("hf", "stop_strings=['']", lambda: _hf_generate(w, stop_strings=[""]), names=("stop",)),
        Case("hf", "temperature 1e-9", lambda: _hf_generate(w, do_sample=True, temperature=1e-9), names=("temperature",)),
        Case("hf", "repetition_penalty", lambda: _hf_generate(w, repetition_penalty=1.3), names=("RepetitionPenalty",)),
        Case("hf", "num_beams=2", lambda: _hf_generate(w, num_beams=2), names=("num_beams",)),
        Case("hf", "speculative(max_nodes=0)", lambda: _hf_call(w, bastion.hf.speculative(str(w.pair.drafter), max_nodes=0)),
             names=("max_nodes",)),
        Case("hf", "speculative(max_nodes='8')", lambda: _hf_call(w, bastion.hf.speculative(str(w.pair.drafter), max_nodes="8")),
             names=("max_nodes",)),
        Case("hf", "speculative(<missing drafter>)", lambda: _hf_call(w, bastion.hf.speculative(str(w.root / "missing-drafter"))),
             names=("missing-drafter",)),
        Case("hf", "speculative(config='x')", lambda: bastion.hf.speculative(str(w.pair.drafter), config="x"), names=("config",)),
        Case("hf", "speculative(component_options=typo)",
             lambda: _hf_call(w, bastion.hf.speculative(str(w.pair.drafter), component_options={"tree_builder": {"bad_option": 1}})),
             names=("bad_option",)),
        Case("hf", "speculative(tree_builder='nosuch')", lambda: _hf_call(w, bastion.hf.speculative(str(w.pair.drafter), tree_builder="nosuch")),
             names=("nosuch",)),
        Case("hf", "standalone call", lambda: bastion.hf.speculative(str(w.pair.drafter))(w.hf[0], None), names=("custom_generate",)),
    ]


def _hf_call(w: World, gen: Any) -> Any:
    import torch

    model, _ = w.hf
    inputs = torch.tensor([PROMPT])
    return model.generate(inputs, attention_mask=torch.ones_like(inputs), custom_generate=gen, max_new_tokens=4)


# ------------------------------------------------------------------------------------------ bastion run
def run_cases(w: World) -> list[Case]:
    cases: list[Case] = []

    def foreign(content: bytes) -> Case:
        folder = w.tmp("foreign")
        out = folder / "notes.jsonl"
        out.write_bytes(content)
        return Case("run", f"foreign output {content[:12]!r}", lambda: cli(w.run_args(w.prompts(), out)), names=("notes.jsonl",),
                    after=_unchanged(out), cli=True)

    cases += [foreign(b'{"note":1}'), foreign(b'{"note":1}\n'), foreign(b"my notes\nline two\n")]

    inp = w.prompts(2)
    cases.append(Case("run", "input == output", lambda: cli(w.run_args(inp, inp)), names=("input",), after=_unchanged(inp), cli=True))
    link_dir = w.tmp("link")
    (link_dir / "link.jsonl").symlink_to(inp)
    cases.append(Case("run", "output is a symlink to the input", lambda: cli(w.run_args(inp, link_dir / "link.jsonl")),
                      names=("input",), after=_unchanged(inp), cli=True))
    cases.append(Case("run", "input == output with --overwrite", lambda: cli(w.run_args(inp, inp, "--overwrite")), names=("input",),
                      after=_unchanged(inp), cli=True))
    folder = w.tmp("dirout")
    cases.append(Case("run", "output is a folder", lambda: cli(w.run_args(w.prompts(), folder)), names=(str(folder),), cli=True))
    blocker = w.tmp("under") / "file"
    blocker.write_text("x")
    cases.append(Case("run", "output under a file", lambda: cli(w.run_args(w.prompts(), blocker / "out.jsonl")), names=(str(blocker),),
                      after=_unchanged(blocker), cli=True))
    cases.append(Case("run", "output in a folder that cannot be written (/proc)",
                      lambda: cli(w.run_args(w.prompts(), "/proc/bastion-out.jsonl")), names=("cannot",), cli=True))
    cases.append(Case("run", "output in a read-only folder", lambda: _read_only(w), names=("out.jsonl", "read-only", "permission"), cli=True))
    for limit in (300, 1500, 4000):
        cases.append(Case("run", f"a disk full after {limit} bytes", lambda n=limit: _full_disk(w, n), names=("out.jsonl",),
                          ok=lambda r: r.out == "20 rows", cli=True))
    bad_dir = w.tmp("badin")
    binary = bad_dir / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 64)
    cases += [
        Case("run", "binary --input", lambda: cli(w.run_args(binary, bad_dir / "o1.jsonl")), names=("binary.jsonl",), cli=True),
        Case("run", "missing --input", lambda: cli(w.run_args(bad_dir / "none.jsonl", bad_dir / "o2.jsonl")), names=("none.jsonl",), cli=True),
        Case("run", "--input a folder", lambda: cli(w.run_args(bad_dir, bad_dir / "o3.jsonl")), names=(str(bad_dir),), cli=True),
        Case("run", "empty --input", lambda: cli(w.run_args(_empty(bad_dir), bad_dir / "o4.jsonl")), names=("empty.jsonl", "no rows", "empty"),
             cli=True),
    ]
    # rows
    row_cases: list[tuple[str, dict[str, Any] | str, tuple[str, ...]]] = [
        ("prompt ''", {"prompt": ""}, ("prompt",)),
        ("prompt 5", {"prompt": 5}, ("prompt",)),
        ("messages without content", {"messages": [{"role": "user"}]}, ("messages[0]", "content")),
        ("content None", {"messages": [{"role": "user", "content": None}]}, ("messages[0]", "content")),
        ("messages []", {"messages": []}, ("messages",)),
        ("prompt and messages", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, ("prompt", "messages")),
        ("unknown key", {"prompt": "a", "temprature": 1}, ("temprature",)),
        ("id true", {"id": True, "prompt": "a"}, ("id",)),
        ("max_tokens and max_new_tokens", {"prompt": "a", "max_tokens": 3, "max_new_tokens": 4}, ("max_tokens",)),
        ("a JSON array", "[1, 2]", ("object", "array", "list")),
        ("malformed JSON", '{"prompt": "a"', ("JSON",)),
        ("openai body without messages", {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}, ("messages",)),
        ("openai unknown url", {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}, ("url", "embeddings")),
    ]
    for label, row, names in row_cases:
        cases.append(Case("run", f"row {label}", lambda r=row: _run_text(w, r), names=names, cli=True))
    dup = [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}]
    cases.append(Case("run", "duplicate ids", lambda: cli(w.run_args(w.prompts(rows=dup), w.tmp("dup") / "o.jsonl")),
                      names=("duplicate",), cli=True))
    # valid runs
    cases += [
        Case("run", "a clean run decodes every row greedily", lambda: _clean(w), ok=bool),
        Case("run", "a prompt holding a raw U+2028", lambda: _run_text(w, {"id": 0, "prompt": "one\u2028two"}),
             ok=lambda r: r.code == 0, cli=True),
        Case("run", "--on-error skip writes error rows", lambda: _skip(w), ok=bool),
        Case("run", "rerun: nothing to do, output unchanged", lambda: _rerun(w), ok=bool),
        Case("run", "resume with other settings", lambda: _resume_other(w), names=("settings",), cli=True),
        Case("run", "torn last line resumed to a clean run", lambda: _torn(w), ok=bool),
        Case("run", "--output - (stdout)", lambda: cli(w.run_args(w.prompts(2), "-")), ok=lambda r: len(_lines(r.out)) == 2, cli=True),
        Case("run", "a second run on a locked output (two processes)", lambda: _locked(w), names=("pid",), cli=True, timeout=150),
        Case("run", "SIGKILL mid-run, then resume, equals a clean run", lambda: _killed(w), ok=bool, timeout=240),
        Case("run", "a bad option in a real process (exit code, no traceback)",
             lambda: subprocess_cli(w.run_args(w.prompts(1), w.tmp("real") / "o.jsonl", "--seed=-1")), names=("seed",), cli=True),
    ]
    return cases


def _lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


def _empty(folder: Path) -> Path:
    path = folder / "empty.jsonl"
    path.write_text("")
    return path


def _run_text(w: World, row: dict[str, Any] | str) -> CliResult:
    folder = w.tmp("row")
    inp = folder / "in.jsonl"
    inp.write_text((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n", encoding="utf-8")
    return cli(w.run_args(inp, folder / "out.jsonl"))


def _clean_rows(w: World, n: int = 3) -> list[dict[str, Any]]:
    folder = w.tmp("clean")
    res = cli(w.run_args(w.prompts(n), folder / "out.jsonl"))
    assert res.code == 0, res.err
    return _rows(folder / "out.jsonl")


@functools.lru_cache(maxsize=None)
def _reference_rows(w: World, n: int = 3) -> str:
    rows = _clean_rows(w, n)
    return json.dumps([(r["id"], r.get("token_ids"), r.get("text")) for r in rows])


def _same_rows(w: World, out: Path, n: int = 3) -> bool:
    rows = _rows(out)
    return json.dumps([(r["id"], r.get("token_ids"), r.get("text")) for r in rows]) == _reference_rows(w, n)


def _clean(w: World) -> bool:
    """``--raw`` rows decode to the target's own greedy tokens of each prompt."""
    inp, out = w.prompts(3), w.tmp("clean") / "out.jsonl"
    if cli(w.run_args(inp, out, "--raw")).code != 0:
        return False
    for i, row in enumerate(_rows(out)):
        ids = w.pipe.encode(f"Question {i}?")[0].tolist()
        if row["id"] != i or row["token_ids"] != w.reference(tuple(ids), 4)[: len(row["token_ids"])] or not row["token_ids"]:
            return False
    return True


def _skip(w: World) -> bool:
    rows = [{"id": 0, "prompt": "fine"}, {"id": 1, "prompt": ""}, {"id": 2, "prompt": "also fine"}]
    out = w.tmp("skip") / "out.jsonl"
    res = cli(w.run_args(w.prompts(rows=rows), out, "--on-error", "skip"))
    got = _rows(out) if out.is_file() else []
    return res.code == 0 and [r["id"] for r in got] == [0, 1, 2] and "error" in got[1] and "error" not in got[0]


def _rerun(w: World) -> bool:
    inp, out = w.prompts(2), w.tmp("rerun") / "out.jsonl"
    if cli(w.run_args(inp, out)).code != 0:
        return False
    before = out.read_bytes()
    res = cli(w.run_args(inp, out))
    return res.code == 0 and out.read_bytes() == before and "nothing to do" in res.err


def _resume_other(w: World) -> CliResult:
    inp, out = w.prompts(2), w.tmp("other") / "out.jsonl"
    assert cli(w.run_args(inp, out)).code == 0
    before = out.read_bytes()
    res = cli(w.run_args(inp, out, "--temperature", "0.5"))
    return res if out.read_bytes() == before else CliResult(0, "", "output changed")


def _torn(w: World) -> bool:
    inp, out = w.prompts(3), w.tmp("torn") / "out.jsonl"
    if cli(w.run_args(inp, out)).code != 0:
        return False
    data = out.read_bytes()
    lines = data.split(b"\n")
    out.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][: len(lines[2]) // 2])  # the last row cut mid-way
    return cli(w.run_args(inp, out)).code == 0 and _same_rows(w, out)


def _read_only(w: World) -> CliResult:
    """A folder the run may not write: simulated with a failing ``open`` for that folder (this audit may
    run as root, which ignores file modes)."""
    import builtins

    folder = w.tmp("ro")
    real_open, real_os_open = builtins.open, os.open

    def refuse(path: Any) -> None:
        if str(path).startswith(str(folder)):
            raise PermissionError(13, "Permission denied", str(path))

    def fake_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *a, **k)

    def fake_os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *a, **k)

    builtins.open, os.open = fake_open, fake_os_open
    try:
        return cli(w.run_args(w.prompts(2), folder / "out.jsonl"))
    finally:
        builtins.open, os.open = real_open, real_os_open


def _full_disk(w: World, limit: int) -> Any:
    """A disk that fills while the output is written: file size limited by ``RLIMIT_FSIZE`` (writes past
    it fail with EFBIG, as on a full disk they fail with ENOSPC)."""
    from bastion.cli.main import main

    folder = w.tmp("full")
    inp = w.prompts(20)
    args = w.run_args(inp, folder / "out.jsonl")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out, err = io.StringIO(), io.StringIO()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    if code == 0:  # everything fitted: the output must then hold every row
        rows = _rows(folder / "out.jsonl")
        return CliResult(code, f"{len({r['id'] for r in rows if 'token_ids' in r})} rows", err.getvalue())
    return CliResult(code, out.getvalue(), err.getvalue())


def _locked(w: World) -> CliResult:
    inp, out = w.prompts(40), w.tmp("lock") / "out.jsonl"
    cmd = [sys.executable, "-m", "bastion", *w.run_args(inp, out, "--batch-size", "1", "--max-new-tokens", "24")]
    first = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None and not (out.is_file() and out.stat().st_size):
            time.sleep(0.05)
        if first.poll() is not None:
            return CliResult(1, "", "the first run ended before the second started")
        return cli(w.run_args(inp, out))
    finally:
        first.kill()
        first.wait()


def _killed(w: World) -> bool:
    inp, out = w.prompts(12), w.tmp("kill") / "out.jsonl"
    args = w.run_args(inp, out, "--batch-size", "1")
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "bastion", *args], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        size = out.stat().st_size if out.is_file() else 0
        while time.monotonic() < deadline and proc.poll() is None and (out.stat().st_size if out.is_file() else 0) <= size:
            time.sleep(0.02)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    res = cli(args)
    return res.code == 0 and _same_rows(w, out, 12)


# ------------------------------------------------------------------------------------------ broken files
def file_cases(w: World) -> list[Case]:
    import torch

    import bastion
    from bastion.contract.registry import registry

    def load(target: Path, drafter: Path | None = None) -> Any:
        pipe = bastion.Pipeline.from_pretrained(target, str(drafter or w.pair.drafter))
        return pipe.generate(PROMPT, 4)

    def copy(kind: str, weights: Callable[[dict], dict] | None = None, config: Callable[[dict], Any] | None = None,
             raw: Callable[[Path], None] | None = None) -> Path:
        from bastion.testing.tiny import mutated_copy

        src = w.pair.target if kind == "target" else w.pair.drafter
        dst = mutated_copy(src, w.tmp(kind) / kind, weights=weights, config=config)
        if raw is not None:
            raw(dst)
        return dst

    def drop(name: str) -> Callable[[dict], dict]:
        return lambda s: {k: v for k, v in s.items() if k != name}

    def setc(**fields: Any) -> Callable[[dict], None]:
        def apply(c: dict) -> None:
            for k, v in fields.items():
                if v is _POP:
                    c.pop(k, None)
                else:
                    c[k] = v
            c.pop("layer_types", None)

        return apply

    def nan(s: dict) -> dict:
        name = "model.layers.0.mlp.down_proj.weight"
        t = s[name].clone()
        t[0, 0] = float("nan")
        return {**s, name: t}

    def write(name: str, blob: bytes) -> Callable[[Path], None]:
        return lambda d: (d / name).write_bytes(blob)

    def cut(name: str, frac: float) -> Callable[[Path], None]:
        def apply(d: Path) -> None:
            data = (d / name).read_bytes()
            (d / name).write_bytes(data[: int(len(data) * frac)])

        return apply

    def remove(name: str) -> Callable[[Path], None]:
        return lambda d: (d / name).unlink()

    def escaping_index(d: Path) -> None:
        (d / "model.safetensors").rename(d / "shard.safetensors")
        from safetensors import safe_open

        with safe_open(str(d / "shard.safetensors"), "pt") as fh:
            keys = list(fh.keys())
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "../shard.safetensors" for k in keys}}))

    target_cases: list[tuple[str, Callable[[], Path], tuple[str, ...]]] = [
        ("target without lm_head", lambda: copy("target", weights=drop("lm_head.weight")), ("lm_head.weight",)),
        ("target without the norm", lambda: copy("target", weights=drop("model.norm.weight")), ("model.norm.weight",)),
        ("target with an unexpected tensor", lambda: copy("target", weights=lambda s: {**s, "model.extra.weight": torch.zeros(3)}),
         ("model.extra.weight",)),
        ("target norm of another shape", lambda: copy("target", weights=lambda s: {**s, "model.norm.weight": torch.ones(7)}),
         ("model.norm.weight",)),
        ("target weights as int64", lambda: copy("target", weights=lambda s: {k: v.to(torch.int64) for k, v in s.items()}), ("int64", "I64")),
        ("target norm as bool", lambda: copy("target", weights=lambda s: {**s, "model.norm.weight": s["model.norm.weight"].bool()}),
         ("model.norm.weight",)),
        ("target weights with NaN", lambda: copy("target", weights=nan), ("down_proj",)),
        ("target num_hidden_layers=10**6", lambda: copy("target", config=setc(num_hidden_layers=10**6)), ("num_hidden_layers",)),
        ("target intermediate_size=10**9", lambda: copy("target", config=setc(intermediate_size=10**9)), ("intermediate_size",)),
        ("target vocab_size=10**10", lambda: copy("target", config=setc(vocab_size=10**10)), ("vocab_size",)),
        ("target num_attention_heads=0", lambda: copy("target", config=setc(num_attention_heads=0, head_dim=_POP)), ("num_attention_heads",)),
        ("target hidden_size=-4", lambda: copy("target", config=setc(hidden_size=-4, head_dim=_POP)), ("hidden_size",)),
        ("target num_hidden_layers='2'", lambda: copy("target", config=setc(num_hidden_layers="2")), ("num_hidden_layers",)),
        ("target vocab_size smaller than the weights", lambda: copy("target", config=setc(vocab_size=100)), ("vocab", "embed_tokens", "lm_head")),
        ("target config.json truncated", lambda: copy("target", raw=write("config.json", b'{"vocab_')), ("config.json",)),
        ("target config.json an array", lambda: copy("target", raw=write("config.json", b"[1, 2]")), ("config.json",)),
        ("target config.json missing", lambda: copy("target", raw=remove("config.json")), ("config.json", "target")),
        ("target safetensors cut in half", lambda: copy("target", raw=cut("model.safetensors", 0.5)), ("model.safetensors",)),
        ("target safetensors header garbled", lambda: copy("target", raw=write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")),
         ("model.safetensors",)),
        ("target safetensors missing", lambda: copy("target", raw=remove("model.safetensors")), ("target", "safetensors", "weights")),
        ("target index naming ../", lambda: copy("target", raw=escaping_index), ("index",)),
        ("target tokenizer.json garbled", lambda: copy("target", raw=write("tokenizer.json", b"{garbage")), ("tokenizer",)),
        ("target tokenizer.json binary", lambda: copy("target", raw=write("tokenizer.json", b"\xff\xfe\x00\x81")), ("tokenizer",)),
    ]
    drafter_cases: list[tuple[str, Callable[[], Path], tuple[str, ...]]] = [
        (f"drafter weights as {dt}", lambda dt=dt: copy("drafter", weights=lambda s: {k: v.to(dt) for k, v in s.items()}), ("model.safetensors",))
        for dt in (torch.int64, torch.bool, torch.int8)
    ] + [
        ("drafter block_size=10**9", lambda: copy("drafter", config=setc(block_size=10**9)), ("block_size",)),
        ("drafter num_attention_heads=0", lambda: copy("drafter", config=setc(num_attention_heads=0, head_dim=_POP)), ("num_attention_heads",)),
        ("drafter num_hidden_layers=10**7", lambda: copy("drafter", config=setc(num_hidden_layers=10**7)), ("num_hidden_layers", "layer")),
        ("drafter hidden_size='big'", lambda: copy("drafter", config=setc(hidden_size="big")), ("hidden_size",)),
        ("drafter without fc.weight", lambda: copy("drafter", weights=drop("fc.weight")), ("fc.weight",)),
        ("drafter safetensors cut", lambda: copy("drafter", raw=cut("model.safetensors", 0.3)), ("model.safetensors",)),
    ] + [
        (f"drafter config.json {label}", lambda blob=blob: copy("drafter", raw=write("config.json", blob)), ("config.json",))
        for label, blob in (("truncated", b'{"hidden'), ("empty", b""), ("an array", b"[1, 2]"), ("binary", b"\x00\xff\xfe\x01"))
    ]
    cases = [Case("files", label, lambda m=make: load(m()), names=names, timeout=60) for label, make, names in target_cases]
    cases += [Case("files", label, lambda m=make: load(w.pair.target, m()), names=names, timeout=60) for label, make, names in drafter_cases]
    cases += [
        Case("files", "drafter_for_checkpoint on a broken config.json",
             lambda: registry.drafter_for_checkpoint(str(copy("drafter", raw=write("config.json", b'{"hid')))), names=("config.json",)),
        Case("files", "model drafter on a DFlash folder", lambda: registry.create("drafter", "model", checkpoint=str(w.pair.drafter)),
             names=("DFlash",)),
        Case("files", "model drafter without embed_tokens",
             lambda: registry.create("drafter", "model", checkpoint=str(copy("target", weights=drop("model.embed_tokens.weight")))),
             names=("embed_tokens",)),
        Case("files", "model drafter of another vocabulary", lambda: _other_vocab(w), names=("vocab",)),
        Case("files", "a DFlash drafter for another target", lambda: _other_target(w), names=("hidden", "vocab", "layer")),
        Case("files", "target folder missing", lambda: load(w.root / "no-target"), names=("no-target",)),
        Case("files", "an empty target folder", lambda: load(w.tmp("empty")), names=("config.json", "empty")),
        Case("files", "drafter folder missing", lambda: load(w.pair.target, w.root / "no-drafter"), names=("no-drafter",)),
        Case("files", "a good pair decodes", lambda: load(w.pair.target), ok=w.greedy(PROMPT, 4)),
        Case("files", "create(drafter, dflash, device='cuda') without CUDA",
             lambda: registry.create("drafter", "dflash", checkpoint=str(w.pair.drafter), device="cuda"), names=("cuda",)),
        Case("files", "create(drafter, dflash, device='meta')",
             lambda: registry.create("drafter", "dflash", checkpoint=str(w.pair.drafter), device="meta"), names=("meta",)),
        Case("files", "create option typo", lambda: registry.create("drafter", "dflash", checkpoint=str(w.pair.drafter), bad_option=1),
             names=("bad_option",)),
        Case("files", "create unknown component", lambda: registry.create("tree_builder", "nosuch"), names=("nosuch",)),
        Case("files", "create unknown kind", lambda: registry.create("nosuchkind", "x"), names=("nosuchkind",)),
        Case("files", "Pipeline max_nodes=0", lambda: bastion.Pipeline(w.pipe.target, w.pipe.drafter, max_nodes=0), names=("max_nodes",)),
        Case("files", "Pipeline max_nodes='8'", lambda: bastion.Pipeline(w.pipe.target, w.pipe.drafter, max_nodes="8"), names=("max_nodes",)),
        Case("files", "Pipeline max_nodes=100000 full (capped)",
             lambda: bastion.Pipeline(w.pipe.target, w.pipe.drafter, max_nodes=100_000, budget_controller="full").generate(PROMPT, 4),
             ok=w.greedy(PROMPT, 4)),
        Case("files", "from_pretrained dtype='int8'", lambda: bastion.Pipeline.from_pretrained(w.pair.target, str(w.pair.drafter), dtype="int8"),
             names=("dtype", "int8")),
        Case("files", "from_pretrained device='gpu0'", lambda: bastion.Pipeline.from_pretrained(w.pair.target, str(w.pair.drafter), device="gpu0"),
             names=("gpu0",)),
        Case("files", "from_pretrained strict_verdicts='yes'",
             lambda: bastion.Pipeline.from_pretrained(w.pair.target, str(w.pair.drafter), strict_verdicts="yes"), names=("strict_verdicts",)),
        Case("files", "Pipeline max_nodes=True", lambda: bastion.Pipeline(w.pipe.target, w.pipe.drafter, max_nodes=True), names=("max_nodes",)),
        Case("files", "Pipeline tree_builder=5", lambda: bastion.Pipeline(w.pipe.target, w.pipe.drafter, tree_builder=5), names=("tree_builder",)),
    ]
    cases += training_cases(w)
    return cases


_POP = object()


def _other_vocab(w: World) -> Any:
    import bastion
    from bastion.testing.tiny import save_tiny_target

    other = save_tiny_target(w.tmp("vocab") / "small", "qwen3", seed=5)  # vocabulary 256
    return bastion.Pipeline.from_pretrained(w.pair.target, "model", component_options={"drafter": {"checkpoint": str(other)}})


def _other_target(w: World) -> Any:
    import bastion
    from bastion.testing.tiny import save_tiny_target

    other = save_tiny_target(w.tmp("other") / "t", "qwen3", seed=5, hidden_size=32, head_dim=8)
    return bastion.Pipeline.from_pretrained(other, str(w.pair.drafter)).generate(PROMPT, 4)


def training_cases(w: World) -> list[Case]:
    import numpy as np
    import torch

    from bastion.training.features import DATA, DONE, META, FeatureStore
    from bastion.training.loop import resume, save_checkpoint

    def model_opt(width: int = 4) -> tuple[Any, Any]:
        model = torch.nn.Linear(width, 3)
        return model, torch.optim.AdamW(model.parameters())

    def ckpt(**state: Any) -> Path:
        path = w.tmp("ckpt") / "checkpoint.pt"
        save_checkpoint(path, **state)
        return path

    def features(damage: str) -> Path:
        folder = w.tmp("features") / "features"
        folder.mkdir()
        meta = {"layer_ids": [0], "width": 4, "offsets": [0, 3, 5], "dtype": "float32"}
        (folder / META).write_text(json.dumps(meta))
        np.zeros((5, 4), dtype=np.float32).tofile(folder / DATA)
        np.ones(2, dtype=np.uint8).tofile(folder / DONE)
        if damage == "not JSON":
            (folder / META).write_text('{"layer_ids": [0], "wid')
        elif damage == "an array":
            (folder / META).write_text("[1, 2]")
        elif damage == "width a string":
            (folder / META).write_text(json.dumps({**meta, "width": "4"}))
        elif damage == "offsets decreasing":
            (folder / META).write_text(json.dumps({**meta, "offsets": [0, 5, 3]}))
        elif damage == "data truncated":
            (folder / DATA).write_bytes((folder / DATA).read_bytes()[:20])
        return folder

    other, other_opt = model_opt(7)
    cases = [
        Case("training", "resume without model", lambda: resume(ckpt(step=3, elapsed=1.0), *model_opt()), names=("model",)),
        Case("training", "resume of another shape",
             lambda: resume(ckpt(model=other.state_dict(), optimizer=other_opt.state_dict(), step=3, elapsed=1.0), *model_opt()),
             names=("checkpoint.pt",)),
        Case("training", "resume from a crafted pickle", lambda: resume(_pickle(w), *model_opt()), names=("checkpoint.pt",)),
        Case("training", "resume from a truncated file", lambda: resume(_truncated_ckpt(w), *model_opt()), names=("checkpoint.pt",)),
    ]
    for damage in ("not JSON", "an array", "width a string", "offsets decreasing"):
        cases.append(Case("training", f"features.json {damage}", lambda d=damage: FeatureStore.open(features(d)), names=(META,)))
    cases.append(Case("training", "features.bin truncated", lambda: FeatureStore.open(features("data truncated")), names=(DATA,)))
    cases.append(Case("training", "a good feature folder opens", lambda: FeatureStore.open(features("none")), ok=lambda s: s.width == 4))
    out_file = w.tmp("trainout") / "out.txt"
    out_file.write_text("keep me")
    cases.append(Case("training", "train drafter --out <existing file>",
                      lambda: cli(["train", "drafter", "--target", str(w.pair.target), "--data", str(w.root / "d.pt"), "--out", str(out_file)]),
                      names=("out.txt",), after=_unchanged(out_file), cli=True))
    binary = w.tmp("distill") / "prompts.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 16)
    cases.append(Case("training", "train distill --prompts <binary>",
                      lambda: cli(["train", "distill", "--target", str(w.pair.target), "--prompts", str(binary), "--out",
                                   str(binary.parent / "d.pt"), "--device", "cpu"]), names=("prompts.jsonl",), cli=True))
    cases.append(Case("training", "calibrate --profile <folder> writes inside it", lambda: _calibrate(w), ok=bool, timeout=120))
    cases += [
        Case("training", f"prompts file row {label}", lambda r=row: _user_prompts(w, [r]), names=names)
        for label, row, names in [
            ("content None", {"messages": [{"role": "user", "content": None}]}, ("content",)),
            ("messages without content", {"messages": [{"role": "user"}]}, ("content",)),
            ("role 5", {"messages": [{"role": 5, "content": "hi"}]}, ("role",)),
            ("prompt ''", {"prompt": ""}, ("prompt",)),
        ]
    ]
    cases.append(Case("training", "prompts file with a raw U+2028", lambda: _user_prompts(w, [{"prompt": "one\u2028two"}, {"prompt": "b"}]),
                      ok=lambda r: len(r) == 2 and "one\u2028two" in r[0][1]))
    return cases


def _user_prompts(w: World, rows: list[dict[str, Any]]) -> Any:
    from bastion.training.prompts import read_user_prompts

    return read_user_prompts(w.prompts(rows=rows), w.pipe.tokenizer)


def _pickle(w: World) -> Path:
    import pickle

    path = w.tmp("pickle") / "checkpoint.pt"
    marker = w.root / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    path.write_bytes(pickle.dumps({"model": Evil()}))
    return path


def _truncated_ckpt(w: World) -> Path:
    import torch

    path = w.tmp("trunc") / "checkpoint.pt"
    torch.save({"model": {"w": torch.zeros(100)}, "step": 1}, path)
    path.write_bytes(path.read_bytes()[:50])
    return path


def _calibrate(w: World) -> bool:
    folder = w.tmp("profiles")
    parent = set(folder.parent.iterdir())
    old = os.environ.get("BASTION_CACHE_DIR")
    os.environ["BASTION_CACHE_DIR"] = str(w.tmp("cache"))
    try:
        res = cli(["calibrate", "--target", str(w.pair.target), "--sizes", "1,4", "--contexts", "8", "--repeats", "1",
                   "--profile", str(folder), "--force", "--device", "cpu", "--plot", str(w.tmp("plot") / "c.png")])  # fmt: skip
    finally:
        if old is None:
            os.environ.pop("BASTION_CACHE_DIR")
        else:
            os.environ["BASTION_CACHE_DIR"] = old
    new = {p for p in set(folder.parent.iterdir()) - parent if not p.name.startswith("plot-")}
    ok = res.code == 0 and (folder / "latency_profiles.json").is_file() and all(p.name.startswith("cache-") for p in new)
    if not ok:
        print(res.code, res.err[-300:], sorted(p.name for p in new))
    return ok


# ------------------------------------------------------------------------------------------ plugins
def plugin_cases(w: World) -> list[Case]:
    import numpy as np
    import torch

    import bastion
    from bastion.controllers.full import FullTreeController
    from bastion.controllers.latency.roofline import RooflineLatency
    from bastion.core import Tree, Verdict
    from bastion.contract.hookspecs import hookimpl
    from bastion.contract.registry import Registry
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.trees.best_first import BestFirstBuilder
    from bastion.verifiers.exact import ExactVerifier

    model = w.pipe.target.model
    vocab = w.vocab

    def pipe(**kw: Any) -> Any:
        kw.setdefault("drafter", NoisyOracleDrafter(model, block_size=4, noise=0.5))
        kw.setdefault("budget_controller", bastion.registry.create("budget_controller", "fixed", budget=8))
        return bastion.Pipeline(w.pipe.target, max_nodes=8, **kw)

    class WrongRoot(BestFirstBuilder):
        builds_valid_trees = True

        def build(self, marginals, root_token, max_nodes):  # type: ignore[no-untyped-def]
            return super().build(marginals, (root_token + 1) % vocab, max_nodes)

    class Oversized(BestFirstBuilder):
        def build(self, marginals, root_token, max_nodes):  # type: ignore[no-untyped-def]
            tree = super().build(marginals, root_token, max_nodes)
            n = len(tree)
            parents = [int(p) for p in tree.parents] + [n - 1 + k for k in range(20)]
            return Tree.from_parents(torch.cat([tree.tokens, torch.full((20,), 3, dtype=torch.long)]), parents)

    class OutOfVocab(BestFirstBuilder):
        builds_valid_trees = True

        def build(self, marginals, root_token, max_nodes):  # type: ignore[no-untyped-def]
            tree = super().build(marginals, root_token, max_nodes)
            tokens = tree.tokens.clone()
            if len(tokens) > 1:
                tokens[1] = vocab + 10
            return Tree.from_parents(tokens, [int(p) for p in tree.parents])

    class Broken(BestFirstBuilder):
        def build(self, marginals, root_token, max_nodes):  # type: ignore[no-untyped-def]
            raise IndexError("list index out of range")

    class FirstChild(ExactVerifier):
        def verify(self, tree, logits, sampling, generator=None):  # type: ignore[no-untyped-def]
            if len(tree) < 2:
                return super().verify(tree, logits, sampling, generator)
            return Verdict(torch.tensor([0, 1]), (int(tree.tokens[1]),), int(logits[1].argmax()))

        def verify_batch(self, trees, logits, sampling, generators):  # type: ignore[no-untyped-def]
            return [self.verify(t, logits[i, : len(t)], sampling[i], generators[i]) for i, t in enumerate(trees)]

    class WrongBonus(ExactVerifier):
        def verify(self, tree, logits, sampling, generator=None):  # type: ignore[no-untyped-def]
            v = super().verify(tree, logits, sampling, generator)
            return Verdict(v.accepted_nodes, v.accepted_tokens, (v.bonus_token + 1) % logits.shape[-1])

        def verify_batch(self, trees, logits, sampling, generators):  # type: ignore[no-untyped-def]
            return [self.verify(t, logits[i, : len(t)], sampling[i], generators[i]) for i, t in enumerate(trees)]

    class Scribbling(NoisyOracleDrafter):
        def begin(self, context):  # type: ignore[no-untyped-def]
            context.tokens[0] = 1
            super().begin(context)

    class WrongType(NoisyOracleDrafter):
        def propose(self, step):  # type: ignore[no-untyped-def]
            return [0.5, 0.5]

    class NumpyController(FullTreeController):
        def choose(self, log_scores, context_len, latency, overhead_s):  # type: ignore[no-untyped-def]
            return np.int64(min(2, int(log_scores.shape[0])))

    class ZeroController(FullTreeController):
        def choose(self, log_scores, context_len, latency, overhead_s):  # type: ignore[no-untyped-def]
            return 0

    class NaNLatency(RooflineLatency):
        def predict_many(self, n_tokens, context_len):  # type: ignore[no-untyped-def]
            return torch.full(n_tokens.shape, float("nan"), dtype=torch.float64)

        def predict_batch(self, widths, context_lens):  # type: ignore[no-untyped-def]
            return torch.full(widths.shape, float("nan"), dtype=torch.float64)

    def batch(p: Any) -> Any:
        return p.generate_batch([PROMPT, PROMPT[:3]], max_new_tokens=12, stop_on_eos=False)

    def single(p: Any) -> Any:
        return p.generate(PROMPT, max_new_tokens=12, stop_on_eos=False)

    cases: list[Case] = []
    for label, make, names in [
        ("builder declaring valid trees, wrong root", lambda: pipe(tree_builder=WrongRoot()), ("WrongRoot",)),
        ("builder returning max_nodes + 20", lambda: pipe(tree_builder=Oversized()), ("Oversized",)),
        ("builder declaring valid trees, token out of vocabulary", lambda: pipe(tree_builder=OutOfVocab()), ("OutOfVocab",)),
        ("builder raising IndexError", lambda: pipe(tree_builder=Broken()), ("Broken",)),
        ("verifier accepting the first child", lambda: pipe(verifier=FirstChild()), ("FirstChild",)),
        ("verifier with a wrong bonus", lambda: pipe(verifier=WrongBonus()), ("WrongBonus",)),
        ("drafter returning a list", lambda: pipe(drafter=WrongType(model, block_size=4)), ("WrongType",)),
        ("controller returning 0", lambda: pipe(budget_controller=ZeroController()), ("ZeroController",)),
        ("latency model predicting NaN", lambda: pipe(budget_controller="bastion", latency_model=NaNLatency()), ("NaNLatency",)),
    ]:
        cases.append(Case("plugins", label, lambda m=make: single(m()), names=names))
        cases.append(Case("plugins", f"{label} (batch)", lambda m=make: batch(m()), names=names))
    cases += [
        Case("plugins", "controller returning np.int64", lambda: single(pipe(budget_controller=NumpyController())),
             ok=w.greedy(PROMPT, 12)),
        Case("plugins", "drafter writing into DraftContext.tokens", lambda: _scribble(w, pipe(drafter=Scribbling(model, block_size=4, noise=0.5))),
             ok=lambda r: r[0] == [PROMPT] and w.greedy(PROMPT, 8)(r[1])),
    ]

    def half_plugin() -> Any:
        plugin = types.ModuleType("half_plugin")

        @hookimpl
        def bastion_register_components(register):  # type: ignore[no-untyped-def]
            register("tree_builder", "half-registered", BestFirstBuilder)
            raise RuntimeError("the plugin broke half-way")

        plugin.bastion_register_components = bastion_register_components  # type: ignore[attr-defined]
        return plugin

    def rollback() -> Any:
        reg = Registry(load_entry_points=False)
        try:
            reg.register_plugin(half_plugin())
        finally:
            if "half-registered" in reg.names("tree_builder"):
                raise AssertionError("half-registered stayed registered")
        return reg

    def unknown_hook() -> Any:
        plugin = types.ModuleType("typo_plugin")
        plugin.bastion_register_component = hookimpl(lambda register: None)  # type: ignore[attr-defined]
        Registry(load_entry_points=False).register_plugin(plugin)

    def empty_name() -> Any:
        plugin = types.ModuleType("empty_name_plugin")
        plugin.bastion_register_components = hookimpl(lambda register: register("tree_builder", "", BestFirstBuilder))  # type: ignore[attr-defined]
        Registry(load_entry_points=False).register_plugin(plugin)

    def bad_kind() -> Any:
        plugin = types.ModuleType("bad_kind_plugin")
        plugin.bastion_register_components = hookimpl(lambda register: register("tree_bilder", "x", BestFirstBuilder))  # type: ignore[attr-defined]
        Registry(load_entry_points=False).register_plugin(plugin)

    def duplicate() -> Any:
        plugin = types.ModuleType("dup_plugin")
        plugin.bastion_register_components = hookimpl(lambda register: register("tree_builder", "best-first", BestFirstBuilder))  # type: ignore[attr-defined]
        Registry(load_entry_points=True).register_plugin(plugin)

    def bad_lazy() -> Any:
        reg = Registry(load_entry_points=False)
        plugin = types.ModuleType("lazy_plugin")
        plugin.bastion_register_components = hookimpl(lambda register: register("tree_builder", "lazy", "no_such_module:Builder"))  # type: ignore[attr-defined]
        reg.register_plugin(plugin)
        return reg.create("tree_builder", "lazy")

    cases += [
        Case("plugins", "hook raising after one register (registers nothing)", rollback, names=("half_plugin",)),
        Case("plugins", "a hook name with a typo", unknown_hook, names=("bastion_register_component",)),
        Case("plugins", "a component with an empty name", empty_name, names=("name", "empty_name_plugin")),
        Case("plugins", "a component of an unknown kind", bad_kind, names=("tree_bilder",)),
        Case("plugins", "a name another source registered", duplicate, names=("best-first",)),
        Case("plugins", "a lazy factory whose module is missing", bad_lazy, names=("no_such_module", "lazy")),
        Case("plugins", "an entry-point plugin failing to import", lambda: _broken_entry_point(w), ok=bool),
    ]
    return cases


def _scribble(w: World, pipe: Any) -> tuple[list[list[int]], Any]:
    import torch

    prompt = torch.tensor([PROMPT])
    out = pipe.generate(prompt, max_new_tokens=8, stop_on_eos=False)
    return prompt.tolist(), out


def _broken_entry_point(w: World) -> bool:
    """A plugin distribution whose module raises on import: a warning naming it, the built-ins still work."""
    import importlib
    import warnings

    from bastion.contract.registry import Registry

    site = w.tmp("site")
    (site / "broken_plugin_mod.py").write_text("raise ImportError('broken on purpose')\n")
    info = site / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[bastion]\nbroken = broken_plugin_mod\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reg = Registry()
            names = reg.names("tree_builder")
        named = any("broken" in str(c.message) for c in caught)
        return named and "best-first" in names and any(f.plugin == "broken" for f in reg.failures())
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()


# ------------------------------------------------------------------------------------------ main
GROUPS: dict[str, Callable[[World], list[Case]]] = {
    "settings": setting_cases,
    "prompts": prompt_cases,
    "hf": hf_cases,
    "run": run_cases,
    "files": file_cases,
    "plugins": plugin_cases,
}


def table(outcomes: Sequence[Outcome]) -> str:
    groups = sorted({o.case.group for o in outcomes})
    head = "| group | cases | " + " | ".join(CLASSES) + " |"
    lines = [head, "|" + "---|" * (len(CLASSES) + 2)]
    for g in [*groups, "total"]:
        sel = [o for o in outcomes if g == "total" or o.case.group == g]
        counts = [sum(o.kind == c for o in sel) for c in CLASSES]
        name = f"**{g}**" if g == "total" else g
        lines.append(f"| {name} | {len(sel)} | " + " | ".join(str(c) for c in counts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="run only these groups of cases (repeatable)")
    parser.add_argument("--match", help="run only cases whose name holds this text")
    parser.add_argument("--list", action="store_true", help="print every case and its class")
    parser.add_argument("--json", help="write every outcome to this JSON file")
    args = parser.parse_args(argv)
    os.environ.setdefault("BASTION_NO_DEVICE_PROBE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bastion-audit-") as tmp:
        old_cwd = os.getcwd()
        os.chdir(tmp)  # bench writes nothing beside the checkout
        try:
            world = World(Path(tmp))
            cases = [c for g in (args.group or GROUPS) for c in GROUPS[g](world)]
            if args.match:
                cases = [c for c in cases if args.match in c.name]
            outcomes = []
            for case in cases:
                outcome = classify(case)
                outcomes.append(outcome)
                if args.list or outcome.kind in (UNCLEAR, WRONG, CRASH):
                    print(f"[{outcome.kind:>14}] {case.group:>8} | {case.name} ({outcome.seconds:.1f}s) {outcome.detail}", flush=True)
            pwned = (Path(tmp) / "pwned").exists()
        finally:
            os.chdir(old_cwd)
    if pwned:
        print("a crafted pickle ran code", flush=True)
    print()
    print(table(outcomes))
    print(f"\n{len(outcomes)} cases in {time.perf_counter() - start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"group": o.case.group, "case": o.case.name, "class": o.kind, "detail": o.detail} for o in outcomes], indent=1))
    bad = [o for o in outcomes if o.kind in (UNCLEAR, WRONG, CRASH)]
    return 1 if bad or pwned else 0


if __name__ == "__main__":
    sys.exit(main())
