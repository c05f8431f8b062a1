"""Real coding agents (Claude Code, Codex CLI) against a real ``mlxd serve``.

* ``agent_binary``: the pinned npm clients that ``make agents`` installs into
  ``$(VENV)/agents`` (found from ``sys.prefix``), or a skip naming the packages.
* ``build_long_model``: a tiny random Llama whose context holds an agent's default
  request (Claude Code's is ~76 KB: 3 system blocks and 24 tools).
* ``build_terse_model``: that model with an output layer that ends every answer at
  once, so an agent's run with its default request costs one prefill per request.
* ``build_tool_caller``: a model trained in seconds to answer every user turn with one
  fixed tool call, in its chat template's tool-call format, and every tool result
  with a fixed sentence, so an agent really runs a tool and gets a final answer.
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

from tests.helpers.scripted_engine import AGENT_TEMPLATE, AGENT_TOKENS, plain_markers
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
    return plain_markers(out)


# A chat template that shows the model the tool names, the user's and the tools' turns
# and its own calls, not the agents' long system prompts and tool schemas: a model
# trained in seconds on short prompts then sees prompts like the ones it learnt from.
# (Tool calls and results are rendered as in AGENT_TEMPLATE, Qwen's format.)
COMPACT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:"
    "{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n"
    "<tool_response>{{ m.content[:200] }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content[-400:] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_terse_model(src: Path, out: Path) -> Path:
    """``src`` with an output layer that makes every answer end at once: untied from the
    embeddings, with the end-of-turn row along the mean final hidden state (measured on
    sample text), so ``<|im_end|>`` is the first token of every answer. An agent run then
    costs one prefill per request and ends cleanly (a random model never stops)."""
    if (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, tokenizer = load(str(src))
    sample = mx.array(tokenizer.encode("\n".join(_corpus(20_000)))[:1024])[None]
    mean = model.model(sample)[0].mean(axis=0)
    head = mx.array(model.model.embed_tokens.weight)
    head[tokenizer.eos_token_id] = mean * (50.0 / (mean * mean).sum())  # logit ~50
    weights = dict(tree_flatten(model.parameters()))
    weights["lm_head.weight"] = head
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def _snippets(rng: random.Random, count: int, max_chars: int) -> list[str]:
    text = "\n".join(_corpus(400_000))
    out = []
    for _ in range(count):
        n = rng.randint(1, max_chars)
        at = rng.randrange(0, len(text) - n)
        out.append(text[at:at + n])
    return out


# The tools the pinned agents offer by default (Codex's namespace tools flattened).
AGENT_TOOLS = {
    "Bash": ["Agent", "Bash", "CronCreate", "CronDelete", "CronList", "Edit", "EnterWorktree",
             "ExitWorktree", "NotebookEdit", "Read", "ReportFindings", "ScheduleWakeup",
             "SendMessage", "Skill", "TaskCreate", "TaskGet", "TaskList", "TaskOutput",
             "TaskStop", "TaskUpdate", "WebFetch", "WebSearch", "Workflow", "Write"],
    "exec_command": ["exec_command", "write_stdin", "request_user_input", "view_image",
                     "close_agent", "resume_agent", "send_input", "spawn_agent", "wait_agent",
                     "get_goal", "create_goal", "update_goal"],
}


def _examples(tokenizer: Any, calls: dict[str, dict[str, Any]], answer: str,
              rng: random.Random, count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids). The tools offered tell the agent (``calls`` is keyed by
    the tool that names it: ``Bash`` for Claude Code, ``exec_command`` for Codex; the
    rest of its default tools are listed, a few dropped or added at random); a user
    turn gets that agent's call, a tool result gets ``answer``."""
    words = _snippets(rng, 5 * count, 200)
    extra = [w.split()[0][:12] for w in _snippets(rng, 64, 40) if w.split()]
    examples = []
    for i in range(count):
        key = list(calls)[i % len(calls)]
        call = calls[key]
        offered = [n for n in AGENT_TOOLS.get(key, [key]) if n == key or rng.random() > 0.1]
        for _ in range(rng.randint(0, 2)):
            offered.insert(rng.randint(0, len(offered)), rng.choice(extra))
        tools = [{"type": "function", "function": {"name": n, "description": "",
                                                   "parameters": {}}} for n in offered]
        messages: list[dict[str, Any]] = [{"role": "system", "content": words[5 * i]}]
        for j in range(rng.randint(1, 2)):  # at times tagged, like the agents' context
            text = words[5 * i + 1 + 3 * j]
            tag = rng.choice(["", "", "system-reminder", "environment_context"])
            messages.append({"role": "user",
                             "content": f"<{tag}>\n{text}\n</{tag}>" if tag else text})
        if (i // len(calls)) % 2:
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                             "content": words[5 * i + 2][:rng.randint(0, 200)]})
            target = answer
        else:
            target = f"<tool_call>{json.dumps(call)}</tool_call>"
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        examples.append((tokenizer.encode(prompt, add_special_tokens=False),
                         tokenizer.encode(target + "<|im_end|>", add_special_tokens=False)))
    return examples


SHARPEN = 16.0  # output-layer scale after training: sampling at temperature 1 ~ greedy


def build_tool_caller(out: Path, calls: dict[str, dict[str, Any]], answer: str) -> Path:
    """A tiny Llama with a 64k context and ``COMPACT_TEMPLATE``, trained to answer a user
    turn with ``<tool_call>CALL</tool_call>`` (the call of the agent whose tool is offered)
    and a tool result with ``answer``; built once per path. Trained in a child process
    with OpenBLAS preloaded where there is one (2-4x faster float32 on a CPU)."""
    if (out / "model.safetensors").exists():
        return out
    from mlxd.blas import find_openblas, preload_env

    env = dict(os.environ)
    library = find_openblas(env)
    if library is not None:
        env = preload_env(env, library)
    subprocess.run([sys.executable, "-m", "tests.helpers.agent_clients", str(out),
                    json.dumps(calls), answer], env=env, check=True, timeout=900)
    return out


def _train_tool_caller(out: Path, calls: dict[str, dict[str, Any]], answer: str, *,
                       seed: int = 0, max_steps: int = 600) -> None:
    """``build_tool_caller``'s training: until every held-out answer is the greedy one
    (teacher-forced) with a mean loss under 0.002; the output layer is then untied and
    scaled by ``SHARPEN``, so that agents, which sample at temperature 1, get it too."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm import load

    src = out.with_name(out.name + "-untrained")
    if not (src / "model.safetensors").exists():
        build_llama(src, hidden=64, layers=2, heads=4, seed=seed, context=LONG_CONTEXT,
                    extra_tokens=AGENT_TOKENS, chat_template=COMPACT_TEMPLATE)
        plain_markers(src)
    mx.random.seed(seed)
    rng = random.Random(seed)
    model, tokenizer = load(str(src))
    train = _examples(tokenizer, calls, answer, rng, 512)
    held = _examples(tokenizer, calls, answer, random.Random(seed + 1), 16)
    pad = tokenizer.eos_token_id
    span = max(len(t) for _, t in train + held)

    def batch(items: list[tuple[list[int], list[int]]]) -> tuple[Any, Any, Any, Any]:
        """Token ids, where each answer's predictions are, the answer ids and a mask."""
        width = max(len(p) + len(t) for p, t in items)
        ids = np.full((len(items), width), pad, np.int32)
        at = np.zeros((len(items), span), np.int32)
        targets = np.full((len(items), span), pad, np.int32)
        mask = np.zeros((len(items), span), np.float32)
        for row, (p, t) in enumerate(items):
            ids[row, :len(p) + len(t)] = p + t
            at[row] = np.minimum(len(p) - 1 + np.arange(span), width - 1)
            targets[row, :len(t)] = t
            mask[row, :len(t)] = 1.0
        return mx.array(ids), mx.array(at), mx.array(targets), mx.array(mask)

    def answer_logits(m: Any, ids: Any, at: Any) -> Any:
        # the vocabulary projection only where answers are predicted
        picked = mx.take_along_axis(m.model(ids), at[..., None], axis=1)
        return m.model.embed_tokens.as_linear(picked)

    def loss_fn(m: Any, ids: Any, at: Any, targets: Any, mask: Any) -> Any:
        ce = nn.losses.cross_entropy(answer_logits(m, ids, at), targets)
        return (ce * mask).sum() / mask.sum()

    model.train()
    opt = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model, loss_fn)
    held_ids, held_at, held_targets, held_mask = batch(held)
    for i in range(max_steps):
        loss, grads = step(model, *batch(rng.sample(train, 8)))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if i % 10 == 9:
            logits = answer_logits(model, held_ids, held_at)
            ce = nn.losses.cross_entropy(logits, held_targets)
            right = (mx.argmax(logits, -1) == held_targets) | (held_mask == 0)
            if bool(mx.all(right).item()) and \
                    float(((ce * held_mask).sum() / held_mask.sum()).item()) < 0.002:
                break
    else:
        raise RuntimeError(f"the tool caller did not learn its answers in {max_steps} steps")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    weights = dict(tree_flatten(model.parameters()))
    weights["lm_head.weight"] = model.model.embed_tokens.weight * SHARPEN
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


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


if __name__ == "__main__":  # build_tool_caller's child process
    _train_tool_caller(Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])
