"""Serving benchmark: OpenAI-compatible servers driven by the official ``openai`` async client at
several concurrencies over the bench prompts.

For each server and each concurrency C (default 1, 2, 4, 8, 16, 32) the script keeps C streamed
requests in flight until every prompt has been answered once, and reports:

- completion tokens/s: the completion tokens of all requests (from the usage chunk) over the wall time;
- TTFT p50 / p95: seconds from sending a request to its first text chunk;
- ITL p50 / p95: inter-token latency, each request's (last chunk - first chunk) / (tokens - 1).

Servers (``--servers``, comma-separated; each started on a free loopback port and stopped afterwards):

- ``bastion``: ``bastion serve`` with its adaptive budget controller;
- ``plain``: ``bastion serve --budget-controller plain`` (speculation off on the same engine);
- ``fixed:N``: ``bastion serve --budget N`` (a fixed tree width of N nodes);
- ``transformers``: ``transformers serve TARGET --continuous-batching`` on the same target (skipped when
  the ``transformers`` command is not installed);
- ``NAME~OPTIONS``: ``bastion serve`` with more options (shell-quoted), e.g. ``thread~--engine thread`` to
  set the engine on a thread of the server's process beside the default (a process of its own);
- ``NAME=URL``: a server that is already running (not started, not stopped), e.g. on another machine;
- ``NAME@DIR``: ``bastion serve`` (adaptive) from the checkout at DIR, e.g. ``prev@../prev`` beside
  ``bastion`` to serve two commits side by side. It runs with DIR as its working directory and first on
  ``PYTHONPATH``: ``python -m`` puts the working directory ahead of ``PYTHONPATH``, so a server started
  by hand from one checkout with ``PYTHONPATH`` naming another serves the first one's code. Each
  server's startup line names the folder its ``bastion`` was imported from.

``--server-args`` go to every ``bastion serve`` (e.g. ``--target DIR --drafter DIR --device cuda``);
without them the demo pair is served. ``--offline`` adds the same prompts decoded in this process
without a server (``Pipeline.generate`` at concurrency 1, ``generate_batch`` over C prompts at a time),
the reference for the server's overhead: it takes its turn among the servers in every round, and the
reference server over it is reported as a paired ratio too (``offline_ratios`` in the JSON). Greedy
decoding throughout.

With ``--repeats R`` every server runs R rounds, the servers taking turns at each concurrency within a
round. The table keeps each server's fastest round; the **paired ratios** (``--reference``, default
``bastion``, over every other server and over the best of them) are taken within each round, where the
servers ran one right after another, and reported as the median over rounds with the smallest and largest
round: on a shared machine whose speed drifts by tens of percent between runs, these are the figures to
compare. Writes ``serve_bench.json`` (every round's points and the paired ratios) and
``serve_bench.png`` (throughput and p50 inter-token latency against concurrency) under ``--out``::

    python benchmarks/serve_bench.py --servers bastion,plain,fixed:4,fixed:16,transformers --prompts 32 \\
        --max-tokens 64 --out results/serve --offline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from bastion.bench.paired import paired_ratios, ratio_table

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32)


@attrs.frozen
class Request:
    """One bench prompt as a request: chat (instruction prompts) or a raw completion (code)."""

    text: str
    chat: bool


@attrs.frozen
class Sample:
    """One answered request: completion tokens, seconds to its first chunk, seconds between its first and
    last chunk."""

    tokens: int
    ttft: float
    span: float


@attrs.frozen
class Point:
    """One (server, concurrency) measurement."""

    server: str
    concurrency: int
    requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None


# ---------------------------------------------------------------------------------------- prompts
def load_requests(datasets: list[str], per_dataset: int, data_dir: str | None) -> list[Request]:
    """The first ``per_dataset`` prompts of each bench data set: math and chat as one user turn, code
    (HumanEval) as a raw completion."""
    from bastion.bench.datasets import load_dataset
    from bastion.bench.templates import TEMPLATES

    out = []
    for spec in datasets:
        for p in load_dataset(spec, limit=per_dataset, data_dir=data_dir):
            instruction = TEMPLATES[p.domain].instruction
            out.append(Request(p.text.strip() if instruction else p.text, chat=instruction))
    return out


# ---------------------------------------------------------------------------------------- servers
@attrs.define
class Server:
    """A server under test: its label, base URL, the model name it serves, and its process (None when
    it was already running)."""

    label: str
    url: str
    model: str
    process: subprocess.Popen[str] | None = None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(url: str, process: subprocess.Popen[str], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with status {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout:.0f} s")


def start_bastion(label: str, extra: list[str], server_args: list[str], env: dict[str, str], checkout: Path | None = None) -> Server:
    """``bastion serve`` on a free port with ``extra`` options (from ``checkout`` when given: its working
    directory and first on ``PYTHONPATH``); its URL read from its startup line."""
    cmd = [sys.executable, "-m", "bastion", "serve", "--port", "0", "--max-running", "64", "--max-queue", "1024",
           *server_args, *extra]
    if checkout is not None:
        env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            cwd=None if checkout is None else str(checkout))
    assert proc.stderr is not None
    for line in proc.stderr:
        print(f"  [{label}] {line.rstrip()}", file=sys.stderr)
        found = re.search(r": (\S+) \(.*\) on (http://\S+?)/v1", line)
        if found:
            model, url = found.group(1), found.group(2)
            _wait_health(url, proc, 120)
            return Server(label, url, model, proc)
    raise RuntimeError(f"{label}: bastion serve exited with status {proc.wait()}")


def start_transformers(target: str, device: str, env: dict[str, str]) -> Server | None:
    """``transformers serve TARGET --continuous-batching`` on a free port (None when not installed)."""
    exe = shutil.which("transformers")
    if exe is None:
        print("  [transformers] not installed: skipped", file=sys.stderr)
        return None
    port = _free_port()
    # the same dtype bastion serve computes in: float32 on the CPU (no fast float16 there), else the checkpoint's
    dtype = "float32" if device.startswith("cpu") else "auto"
    cmd = [exe, "serve", target, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", dtype]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc, 300)
    except RuntimeError as exc:
        proc.kill()
        log.seek(0)
        last = ([line.strip() for line in log.read().splitlines() if line.strip()] or [""])[-1]
        print(f"  [transformers] {exc} ({last[:200]}): skipped", file=sys.stderr)
        return None
    return Server("transformers", url, target, proc)


def demo_target() -> str:
    from bastion.demo import demo_paths

    return str(demo_paths().target)


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else default


def start_server(spec: str, server_args: list[str], env: dict[str, str]) -> Server | None:
    if "~" in spec:
        label, options = spec.split("~", 1)
        if not label:
            raise SystemExit(f"{spec!r}: NAME~OPTIONS needs a name")
        return start_bastion(label, shlex.split(options), server_args, env)
    if "=" in spec:
        label, url = spec.split("=", 1)
        import httpx

        model = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]
        return Server(label, url.rstrip("/"), model)
    if "@" in spec:
        label, folder = spec.split("@", 1)
        checkout = Path(folder).expanduser().resolve()
        if not label or not (checkout / "bastion" / "__init__.py").is_file():
            raise SystemExit(f"{spec!r}: NAME@DIR needs a name and a checkout of bastion at DIR (no bastion/__init__.py in {checkout})")
        return start_bastion(label, [], server_args, env, checkout)
    if spec == "bastion":
        return start_bastion(spec, [], server_args, env)
    if spec == "plain":
        return start_bastion(spec, ["--budget-controller", "plain"], server_args, env)
    if spec.startswith("fixed:"):
        return start_bastion(spec, ["--budget", spec.split(":", 1)[1]], server_args, env)
    if spec == "transformers":
        return start_transformers(_arg(server_args, "--target", demo_target()), _arg(server_args, "--device", "cpu"), env)
    raise SystemExit(f"unknown server {spec!r}: bastion, plain, fixed:N, transformers, NAME~OPTIONS, NAME=URL or NAME@DIR")


# ---------------------------------------------------------------------------------------- driving
async def one_request(client: Any, model: str, req: Request, max_tokens: int) -> Sample:
    """Send one streamed request; time its first and last text chunks; its tokens from the usage chunk
    (or the chunks' count when the server sends no usage)."""
    kw = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    if req.chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": req.text}], **kw)
    else:
        stream = await client.completions.create(prompt=req.text, **kw)
    first = last = None
    chunks = 0
    tokens = None
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            piece = choice.delta.content if req.chat else choice.text
            if piece:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                chunks += 1
    if first is None or last is None:
        return Sample(tokens or 0, time.perf_counter() - t0, 0.0)
    return Sample(tokens if tokens is not None else chunks, first - t0, last - first)


async def drive(server: Server, requests: list[Request], concurrency: int, max_tokens: int) -> Point:
    """Every request once, ``concurrency`` of them in flight at any time."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(req: Request) -> Sample:
        async with gate:
            return await one_request(client, server.model, req, max_tokens)

    try:
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(gated(r) for r in requests))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return summarize(server.label, concurrency, samples, wall)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(label: str, concurrency: int, samples: list[Sample], wall: float) -> Point:
    tokens = sum(s.tokens for s in samples)
    ttft = [s.ttft for s in samples]
    itl = [s.span / (s.tokens - 1) for s in samples if s.tokens > 1]
    return Point(label, concurrency, len(samples), tokens, wall, tokens / wall if wall > 0 else 0.0,
                 _pct(ttft, 50), _pct(ttft, 95), _pct(itl, 50), _pct(itl, 95))


class OfflineDecoder:
    """The same prompts decoded in this process, without a server: ``generate`` one by one at
    concurrency 1, ``generate_batch`` over C prompts at a time above (no TTFT or ITL: whole results
    only). It takes its turn among the servers in every round (:func:`serve_points`), so the server's
    overhead is a ratio paired within rounds like the others, not one taken minutes apart."""

    label = "offline"

    def __init__(self, server_args: list[str], requests: list[Request]) -> None:
        import torch

        from bastion.cli.main import build_parser
        from bastion.cli.options import build_pipeline

        self.pipe = build_pipeline(build_parser().parse_args(["serve", *server_args]))
        pipe = self.pipe
        self.rows = [(pipe.encode_chat([{"role": "user", "content": r.text}]) if r.chat else pipe.encode(r.text))[0] for r in requests]
        with torch.inference_mode():
            pipe.generate(self.rows[0], 8)  # warm-up

    def point(self, concurrency: int, max_tokens: int) -> Point:
        import torch

        pipe, rows, c = self.pipe, self.rows, concurrency
        with torch.inference_mode():
            t0 = time.perf_counter()
            if c == 1:
                tokens = sum(len(pipe.generate(r, max_tokens).tokens) for r in rows)
            else:
                tokens = sum(len(res.tokens) for k in range(0, len(rows), c) for res in pipe.generate_batch(rows[k:k + c], max_tokens))
            wall = time.perf_counter() - t0
        return Point(self.label, c, len(rows), tokens, wall, tokens / wall, None, None, None, None)


# ---------------------------------------------------------------------------------------- report
def plot(points: list[Point], path: Path) -> None:
    """Throughput and p50 inter-token latency against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(p.server for p in points):
        mine = sorted((p for p in points if p.server == label), key=lambda p: p.concurrency)
        xs = [p.concurrency for p in mine]
        ax1.plot(xs, [p.tokens_per_s for p in mine], marker="o", label=label)
        lat = [(p.concurrency, p.itl_p50 * 1e3) for p in mine if p.itl_p50 is not None]
        if lat:
            ax2.plot([x for x, _ in lat], [y for _, y in lat], marker="o", label=label)
    for ax, title, unit in ((ax1, "throughput", "completion tokens / s"), (ax2, "inter-token latency p50", "ms / token")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p.concurrency for p in points}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def table(points: list[Point]) -> str:
    """A Markdown table of every point."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = ["| server | C | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.server} | {p.concurrency} | {p.tokens_per_s:.1f} | {ms(p.ttft_p50)} | {ms(p.ttft_p95)} | "
                     f"{ms(p.itl_p50)} | {ms(p.itl_p95)} |")
    return "\n".join(lines)


def fastest(rounds: list[list[Point]]) -> list[Point]:
    """The fastest round's point of each (server, concurrency), in first-seen order."""
    best: dict[tuple[str, int], Point] = {}
    for points in rounds:
        for point in points:
            kept = best.get((point.server, point.concurrency))
            if kept is None or point.tokens_per_s > kept.tokens_per_s:
                best[(point.server, point.concurrency)] = point
    return list(best.values())


def serve_points(
    specs: list[str], server_args: list[str], env: dict[str, str], requests: list[Request], concurrencies: list[int],
    max_tokens: int, repeats: int, offline: OfflineDecoder | None = None,
) -> list[list[Point]]:
    """Every server up at once (idle ones cost nothing), then ``repeats`` rounds in which, at each
    concurrency, the servers (and ``offline``, decoding in this process while they idle) take turns: a
    burst of foreign load on a shared machine falls on one round of every server alike rather than on
    one server's whole run. Who goes first rotates with the round and the concurrency, so no server
    always runs right after the same one (or first at every level).
    -> each round's points (see :func:`fastest` and :func:`bastion.bench.paired.paired_ratios`)."""
    servers: list[Server] = []
    try:
        for spec in specs:
            server = start_server(spec, server_args, env)
            if server is not None:
                servers.append(server)
                asyncio.run(drive(server, requests[: max(2, min(4, len(requests)))], 2, 8))  # warm-up, not recorded
        turns: list[Server | OfflineDecoder] = [*servers, *([offline] if offline is not None else [])]
        rounds: list[list[Point]] = []
        for r in range(repeats):
            points: list[Point] = []
            for k, c in enumerate(concurrencies):
                shift = (r + k) % len(turns) if turns else 0
                for turn in turns[shift:] + turns[:shift]:
                    if isinstance(turn, OfflineDecoder):
                        point = turn.point(c, max_tokens)
                    else:
                        point = asyncio.run(drive(turn, requests, c, max_tokens))
                    print(f"  {turn.label} c={c}: {point.tokens_per_s:.1f} tok/s  ttft p50 {point.ttft_p50 or 0:.3f} s  "
                          f"itl p50 {(point.itl_p50 or 0) * 1e3:.1f} ms", file=sys.stderr)
                    points.append(point)
            rounds.append(points)
        return rounds
    finally:
        for server in servers:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="bastion,plain,fixed:4,fixed:16,transformers",
                    help="comma-separated: bastion, plain, fixed:N, transformers, NAME~OPTIONS (bastion serve with OPTIONS), NAME=URL, "
                         "NAME@DIR (bastion serve from the checkout at DIR)")
    ap.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCIES)), help="comma-separated levels")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt_bench", help="bench data sets (see bastion bench)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per data set (default 16)")
    ap.add_argument("--data-dir", default=None, help="where the data sets are (default: as bastion bench finds them)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    ap.add_argument("--server-args", default="", help="options for every bastion serve, e.g. '--target DIR --drafter DIR'")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the servers (default: inherited)")
    ap.add_argument("--offline", action="store_true", help="also decode the prompts in this process, without a server")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over every (concurrency, server), servers taking turns in each round; the table keeps the fastest round "
                         "of each, the paired ratios take the median over rounds of ratios within a round (default 1)")
    ap.add_argument("--reference", default="bastion",
                    help="the server whose paired per-round ratios over the others (transformers aside) are reported (default bastion)")
    ap.add_argument("--out", default="serve-bench", help="output folder for serve_bench.json and serve_bench.png")
    args = ap.parse_args(argv)

    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    server_args = shlex.split(args.server_args)
    requests = load_requests(args.datasets.split(","), args.prompts, args.data_dir)
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    offline = None
    if args.offline:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        offline = OfflineDecoder(server_args, requests)
    rounds = serve_points([s for s in args.servers.split(",") if s], server_args, env, requests, concurrencies, args.max_tokens,
                          args.repeats, offline)
    points = fastest(rounds)
    labels = list(dict.fromkeys(p.server for p in points))
    against = [name for name in labels if name not in (args.reference, "transformers", OfflineDecoder.label)]
    rates = [{(p.server, p.concurrency): p.tokens_per_s for p in r} for r in rounds]
    ratios = paired_ratios(rates, args.reference, against)  # empty without the reference or anything to compare
    overhead = paired_ratios(rates, args.reference, [OfflineDecoder.label]) if offline is not None else []
    result = {
        "config": {"servers": args.servers, "concurrency": concurrencies, "datasets": args.datasets, "prompts": len(requests),
                   "max_tokens": args.max_tokens, "server_args": server_args, "threads": args.threads, "repeats": args.repeats},
        "points": [attrs.asdict(p) for p in points],
        "rounds": [[attrs.asdict(p) for p in r] for r in rounds],
        "paired_ratios": {"reference": args.reference, "ratios": [attrs.asdict(r) for r in ratios]},
        "offline_ratios": {"reference": args.reference, "ratios": [attrs.asdict(r) for r in overhead]},
    }
    (out / "serve_bench.json").write_text(json.dumps(result, indent=2))
    if points:
        plot(points, out / "serve_bench.png")
    print(table(points))
    if ratios:
        print(f"\nPaired ratios, {args.reference} over each server within the same round (median over {args.repeats} "
              "round(s), smallest-largest round in brackets):\n")
        print(ratio_table(ratios, args.reference))
    if overhead:
        print(f"\nServer overhead, {args.reference} over offline decoding in this process within the same round (median over "
              f"{args.repeats} round(s), smallest-largest round in brackets):\n")
        print(ratio_table(overhead, args.reference))
    print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
