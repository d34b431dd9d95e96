"""vLLM's OpenAI-compatible server, started the way the README tells a user to, and a
plain HTTP client for it (the end-to-end tests and ``benchmarks/bench_vllm_ttft.py``).

    with VLLMServer(model_dir, kvtier_config="configs/vllm.yaml") as server:
        reply = server.complete(prompt_ids, max_tokens=8)   # greedy token ids, TTFT
        server.cached_tokens()                              # vLLM's counters, by source

The server is ``python -m vllm.entrypoints.openai.api_server`` with vLLM's defaults
(its engine core and each worker in processes of their own) and kvtier's connector
configured by ``--kv-transfer-config``, exactly as in the README; ``args`` adds any
other ``vllm serve`` flag. Prompts are token ids and replies come back as token ids
(``return_token_ids``), so no tokenizer is involved on either side.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.progress import progress

# The README's setting for vLLM's CPU build on a small machine: the core reservation vLLM
# makes without a connector (one core per rank; a connector would double it, and on a
# few cores leave the compute threads bound to every core).
SMALL_MACHINE_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}

# Sources of vLLM's ``prompt_tokens_cached_by_source`` counter, as it names them.
SOURCES = ("device", "host", "disk", "external_unspecified")


def kv_transfer_config(
    kvtier_config: str | Path,
    module: str = "kvtier.integrations.vllm",
    connector: str = "KVTierConnector",
) -> str:
    """The ``--kv-transfer-config`` value that loads kvtier with a YAML config (from
    ``module``, class ``connector``: one that subclasses, wraps or stands in for the
    connector, e.g. in tests and benchmarks)."""
    return json.dumps(
        {
            "kv_connector": connector,
            "kv_connector_module_path": module,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": str(kvtier_config)},
        }
    )


@dataclass(frozen=True)
class Reply:
    """One completion: its greedy tokens and the time to its first token (seconds,
    measured by the client from sending the request to the first streamed token)."""

    tokens: list[int]
    ttft: float


class ReplyError(RuntimeError):
    """A streamed completion that ended in vLLM's error object (``error``: its
    ``message``, ``type`` and ``code``, e.g. a request vLLM failed)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('type')} ({error.get('code')}): {error.get('message')}")
        self.error = error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One ``vllm serve`` process tree on a free loopback port (a context manager)."""

    def __init__(
        self,
        model: str | Path,
        kvtier_config: str | Path | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 600,
    ) -> None:
        self.model = str(model)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--port", str(self.port), *(args or []),
        ]  # fmt: skip
        if kvtier_config is not None:
            command += ["--kv-transfer-config", kv_transfer_config(kvtier_config)]
        self.log_path = Path(log_path) if log_path else None
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            command,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches every child
        )
        if log is not subprocess.DEVNULL:
            log.close()
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def complete(self, prompt: list[int], max_tokens: int = 8, **fields: Any) -> Reply:
        """Greedy completion of token ids ``prompt``, streamed (to time the first token).
        ``fields`` go into the request as they are (``model``: a LoRA adapter's name,
        ``cache_salt``). A reply that ends in an error raises ``ReplyError``."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "return_token_ids": True,
            **fields,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        tokens: list[int] = []
        start = time.perf_counter()
        ttft = None
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                data = line.decode().strip().removeprefix("data: ")
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ReplyError(chunk["error"])
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - start
                tokens += ids
        return Reply(tokens, ttft if ttft is not None else time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, by name with labels (``name{label="v",...}``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def cached_tokens(self) -> dict[str, int]:
        """Prompt tokens not computed so far, by source (vLLM's
        ``prompt_tokens_cached_by_source``: ``device`` is vLLM's own prefix cache, the
        others are kvtier's tiers as the connector reports them)."""
        samples = self.metrics()
        out = dict.fromkeys(SOURCES, 0)
        for name, value in samples.items():
            if name.startswith("vllm:prompt_tokens_cached_by_source_total{"):
                source = name.split('source="')[1].split('"')[0]
                out[source] = out.get(source, 0) + int(value)
        return out

    def stop(self, timeout: float = 120) -> int:
        """Stop the server as Ctrl-C does (vLLM shuts its workers down, and the
        connector finishes its writes); kill it if it does not exit in ``timeout``."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGINT)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        return self._proc.returncode

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for _ in progress(itertools.count(), desc=f"starting vLLM on :{self.port}, polls"):
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self._proc.returncode}{self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not healthy after {timeout:.0f} s{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return ":\n" + self.log_path.read_text(errors="replace")[-6000:]
