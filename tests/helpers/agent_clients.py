"""Real coding agents (Claude Code, Codex CLI) against a real ``mlxd serve``.

* ``agent_binary``: the pinned npm clients that ``make agents`` installs into
  ``$(VENV)/agents`` (found from ``sys.prefix``), or a skip naming the packages.
* ``build_long_model``: a tiny random Llama whose context holds an agent's default
  request (Claude Code's is ~76 KB: 3 system blocks and 24 tools).
* ``train_tool_caller``: the same model trained in seconds to answer every user turn
  with one fixed tool call, in its chat template's tool-call format, and every tool
  result with a fixed sentence, so an agent really runs a tool and gets a final answer.
* ``MlxdServe``: ``python -m mlxd serve`` on 127.0.0.1 with a JSON log that tells the
  status of each request.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.scripted_engine import AGENT_TEMPLATE, AGENT_TOKENS
from tests.helpers.server import free_port, wait_serving
from tests.helpers.tiny_models import _corpus, build_llama

AGENT_PACKAGES = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0"}
LONG_CONTEXT = 65_536


def agent_binary(name: str) -> Path:
    """``claude`` or ``codex`` from the venv's pinned install, else skip the test."""
    path = Path(sys.prefix) / "agents" / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.skip(f"{AGENT_PACKAGES[name]} is not installed in {path.parent.parent.parent}: "
                    "run `make agents` (needs npm)")
    if shutil.which("node") is None and name == "codex":
        pytest.skip(f"{AGENT_PACKAGES[name]} needs node on PATH")
    return path


def build_long_model(out: Path) -> Path:
    """A tiny Llama (2 layers, width 64) with a 64k context and the Qwen-like agent
    template (``<tool_call>`` JSON calls, ``<think>`` reasoning); built once per path."""
    if (out / "model.safetensors").exists():
        return out
    # 8192 tokens of vocabulary: Claude Code's default request is ~26k tokens (~33k with 2048)
    build_llama(out, hidden=64, layers=2, heads=4, seed=0, context=LONG_CONTEXT,
                vocab_size=8192, extra_tokens=AGENT_TOKENS, chat_template=AGENT_TEMPLATE)
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    for token in spec["added_tokens"]:
        if token["content"] in AGENT_TOKENS:
            token["special"] = False  # markers decode as text, as in Qwen's tokenizer
    path.write_text(json.dumps(spec))
    return out


def _snippets(rng: random.Random, count: int, max_chars: int) -> list[str]:
    text = "\n".join(_corpus(400_000))
    out = []
    for _ in range(count):
        n = rng.randint(1, max_chars)
        at = rng.randrange(0, len(text) - n)
        out.append(text[at:at + n])
    return out


def _examples(tokenizer: Any, call: dict[str, Any], answer: str, rng: random.Random,
              count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids): a user turn gets ``call``, a tool result gets ``answer``."""
    words = _snippets(rng, 4 * count, 160)
    body = json.dumps(call)
    examples = []
    for i in range(count):
        # Shaped like the agents' requests: a system prompt (Codex: developer messages),
        # the user's turn, and at times a late system message (Claude Code's agent list).
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.8:
            messages.append({"role": "system", "content": words[4 * i]})
        messages.append({"role": "user", "content": words[4 * i + 1]})
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": words[4 * i + 3]})
        if i % 2:
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                             "content": words[4 * i + 2][:rng.randint(0, 80)]})
            target = answer
        else:
            target = f"<tool_call>{body}</tool_call>"
        prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        examples.append((tokenizer.encode(prompt, add_special_tokens=False),
                         tokenizer.encode(target + "<|im_end|>", add_special_tokens=False)))
    return examples


def train_tool_caller(src: Path, out: Path, call: dict[str, Any], answer: str, *,
                      seed: int = 0, max_steps: int = 300) -> Path:
    """Train the model in ``src`` to answer a user turn with ``<tool_call>CALL</tool_call>``
    and a tool result with ``answer``, until both are its greedy answers on held-out
    prompts (teacher-forced); save it to ``out`` (reused when it exists)."""
    if (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm import load

    mx.random.seed(seed)
    rng = random.Random(seed)
    model, tokenizer = load(str(src))
    train = _examples(tokenizer, call, answer, rng, 256)
    held = _examples(tokenizer, call, answer, random.Random(seed + 1), 16)
    pad = tokenizer.eos_token_id
    span = max(len(t) for _, t in train + held)

    def batch(items: list[tuple[list[int], list[int]]]) -> tuple[Any, Any, Any, Any]:
        """Token ids, where each answer starts, the answer ids and their mask."""
        width = max(len(p) + len(t) for p, t in items)
        ids = np.full((len(items), width + span), pad, np.int32)
        starts = np.zeros((len(items), span), np.int32)
        targets = np.full((len(items), span), pad, np.int32)
        mask = np.zeros((len(items), span), np.float32)
        for row, (p, t) in enumerate(items):
            ids[row, :len(p) + len(t)] = p + t
            starts[row] = len(p) - 1 + np.arange(span)
            targets[row, :len(t)] = t
            mask[row, :len(t)] = 1.0
        return mx.array(ids[:, :width]), mx.array(starts), mx.array(targets), mx.array(mask)

    def answer_logits(m: Any, ids: Any, starts: Any) -> Any:
        # the vocabulary projection only where answers are predicted: the rest is context
        hidden = m.model(ids)
        at = mx.minimum(starts, ids.shape[1] - 1)
        picked = mx.take_along_axis(hidden, at[..., None], axis=1)
        return m.model.embed_tokens.as_linear(picked)

    def loss_fn(m: Any, ids: Any, starts: Any, targets: Any, mask: Any) -> Any:
        ce = nn.losses.cross_entropy(answer_logits(m, ids, starts), targets)
        return (ce * mask).sum() / mask.sum()

    model.train()
    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model, loss_fn)
    held_batch = batch(held)
    for i in range(max_steps):
        loss, grads = step(model, *batch(rng.sample(train, 16)))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if i % 10 == 9:
            ids, starts, targets, mask = held_batch
            guess = mx.argmax(answer_logits(model, ids, starts), -1)
            if bool(mx.all((guess == targets) | (mask == 0)).item()):
                break
    else:
        raise RuntimeError(f"the tool caller did not learn its answers in {max_steps} steps")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return out


class MlxdServe:
    """``python -m mlxd serve MODEL`` on 127.0.0.1, logging one JSON line per request."""

    def __init__(self, model: Path, name: str, home: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = log
        cmd = [sys.executable, "-m", "mlxd", "serve", str(model), "--served-model-name", name,
               "--host", "127.0.0.1", "--port", str(self.port), "--no-starter",
               "--log-format", "json", *extra]
        env = dict(os.environ, MLXD_HOME=str(home), HF_HUB_OFFLINE="1")
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        wait_serving(self.proc, self.url, self.log, timeout)

    def requests(self) -> list[dict[str, Any]]:
        """The request lines logged so far (route, status, model, tokens...)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "status" in record and "route" in record:
                out.append(record)
        return out

    def errors(self, since: int = 0) -> list[dict[str, Any]]:
        """Requests after the first ``since`` that got a 4xx or 5xx."""
        return [r for r in self.requests()[since:] if int(r["status"]) >= 400]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
