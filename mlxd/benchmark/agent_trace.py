"""A deterministic coding-agent trace: sessions in the Anthropic Messages shape.

Each session is what a coding agent (Claude Code and the like) sends a server:
the same long system prompt and a dozen tool definitions every turn, then a
history that grows by one turn at a time. A session reads a few real source
files (modules of the Python standard library installed on this machine, by a
fixed list, each recorded with its SHA-256) through ``read_file`` tool calls,
and every turn asks for the next small edit ("repeat function ``f`` with ``a``
renamed to ``b``"), so a model's greedy answer copies from its context.

The history is recorded, not generated: turn k+1 holds turn k's *recorded*
answer (the correct edit, made here with ``tokenize``), so every server sees
the same prompts whatever it answered. ``trace_digest`` hashes all requests:
the same spec and the same Python give the same digest on any machine.

No MLX and no tokenizer here (rank-1 layer): sizes are kept in range by
characters (~4 characters per token of Python for byte-level BPE vocabularies).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import random
import sysconfig
import textwrap
import tokenize
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlxd.benchmark.agent_prompts import SYSTEM_SECTIONS, TOOLS

# Standard-library modules of 1.3-1.9k tokens each (5-8 KB of Python): small enough that
# two of them, the system prompt and eight turns fit an 8k context (SmolLM2).
SOURCE_FILES = ("fnmatch", "genericpath", "linecache", "reprlib", "sched", "colorsys", "codeop",
                "getpass", "netrc", "copyreg")
# The digest of ``build_trace(TraceSpec())`` (what ``--trace agent --sessions 1,4`` sends)
# per Python version: the stdlib files differ between versions. Change it only on purpose.
RECORDED_DIGESTS = {
    "3.11.7": "56b21751220f2605d97e9f17ff51419f0b80b6bc8d6360bfbb70aec7d4444c44"}
RENAME_WORDS = ("value", "item", "arg", "input", "obj")
INSTRUCTIONS = (
    "Repeat the function `{qual}` from `{path}` with `{old}` renamed to `{new}`. "
    "Reply with the complete function in a python code block.",
    "In `{path}`, rename `{old}` to `{new}` in `{qual}` and show me the whole updated function.",
    "Next edit: `{qual}` in `{path}`, where `{old}` becomes `{new}`. Print the full function.",
)


@dataclass(frozen=True)
class TraceSpec:
    """The size and seed of a trace.

    Args:
        sessions: how many sessions (each reads its own files).
        turns: requests per session (each ends with a user or tool_result message).
        files_per_session: source files read per session (one ``read_file`` each).
        seed: picks files, functions, names and wording.
        max_tokens: the answer budget of every request.
        tools: how many of the tool definitions the requests carry (at most 12).
        system_sections: how many sections of the system prompt (at most 8).
        max_file_chars: source files are cut at a line boundary to at most this size.
    """

    sessions: int = 5
    turns: int = 8
    files_per_session: int = 2
    seed: int = 0
    max_tokens: int = 256
    tools: int = len(TOOLS)
    system_sections: int = len(SYSTEM_SECTIONS)
    max_file_chars: int = 8000

    def __post_init__(self) -> None:
        if not 1 <= self.sessions <= 1000 or not 1 <= self.turns <= 64:
            raise ValueError("sessions must be 1-1000 and turns 1-64")
        if not 1 <= self.files_per_session <= self.turns:
            raise ValueError("files_per_session must be between 1 and turns")
        if not 0 <= self.tools <= len(TOOLS) or not 0 <= self.system_sections <= len(
                SYSTEM_SECTIONS):
            raise ValueError(f"tools must be 0-{len(TOOLS)}, system_sections "
                             f"0-{len(SYSTEM_SECTIONS)}")
        if self.max_tokens < 1 or self.max_file_chars < 200:
            raise ValueError("max_tokens must be >= 1 and max_file_chars >= 200")


@dataclass(frozen=True)
class Edit:
    """One recorded edit: ``old`` renamed to ``new`` in function ``qual`` of ``path``."""

    path: str
    qual: str
    old: str
    new: str
    before: str
    after: str


@dataclass
class Session:
    """One session: ``turns[k]`` is the message list of request k (Anthropic shape)."""

    index: int
    files: list[str]
    turns: list[list[dict[str, Any]]] = field(default_factory=list)
    edits: list[Edit] = field(default_factory=list)


@dataclass
class AgentTrace:
    """A whole trace: the shared system prompt and tools, the sessions, the sources."""

    spec: TraceSpec
    system: str
    tools: list[dict[str, Any]]
    sessions: list[Session]
    sources: dict[str, str]  # path -> SHA-256 of the text put in the tool_result
    python: str

    def digest(self) -> str:
        """SHA-256 of every request of the trace (what a server receives)."""
        h = hashlib.sha256()
        for s in self.sessions:
            for k in range(len(s.turns)):
                h.update(json.dumps(anthropic_body(self, s.index, k, "m"),
                                    sort_keys=True).encode())
        return h.hexdigest()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_source(name: str, max_chars: int) -> str:
    """A stdlib module's text, cut after the last whole top-level statement that ends
    within ``max_chars`` (so the cut file still parses)."""
    text = (stdlib_dir() / f"{name}.py").read_text(encoding="utf-8")
    if len(text) <= max_chars:
        return text
    lines = text.splitlines(keepends=True)
    ends = [len("".join(lines[:node.end_lineno])) for node in ast.parse(text).body
            if node.end_lineno]
    fitting = [e for e in ends if e <= max_chars]
    return text[:fitting[-1]] if fitting else text[: text.rfind("\n", 0, max_chars) + 1]


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef]]:
    """Top-level functions and methods, as (qualified name, node), in source order."""
    out: list[tuple[str, ast.FunctionDef]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            out += [(f"{node.name}.{n.name}", n) for n in node.body
                    if isinstance(n, ast.FunctionDef)]
    return out


def _renamable(node: ast.FunctionDef) -> list[str]:
    """Parameters (not self/cls), then local names assigned in the body, without repeats."""
    names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)
             if a.arg not in ("self", "cls")]
    names += [t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)]
    return [n for i, n in enumerate(names) if n not in names[:i] and len(n) > 1]


def rename(source: str, old: str, new: str) -> str:
    """``source`` with the variable ``old`` renamed to ``new``: attribute names
    (``x.old``) and keyword arguments in calls (``f(old=...)``) are left alone."""
    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    depth, header, out = 0, True, []
    for i, tok in enumerate(toks):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.OP and tok.string == ":" and depth == 0:
            header = False
        prev = toks[i - 1].string if i else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        is_kwarg = not header and depth > 0 and nxt == "=" and prev in ("(", ",")
        if tok.type == tokenize.NAME and tok.string == old and prev != "." and not is_kwarg:
            tok = tok._replace(string=new)
        out.append(tok)
    return tokenize.untokenize(out)


def _segment(lines: list[str], node: ast.FunctionDef) -> str:
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return textwrap.dedent("".join(lines[start - 1: node.end_lineno]))


def edits_for(path: str, text: str, rng: random.Random, count: int) -> list[Edit]:
    """``count`` renames in short functions of ``text`` (4-30 lines), in file order:
    distinct functions first, then other names in functions already used."""
    lines = text.splitlines(keepends=True)
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a file cut inside its first statement: no edits
        return []
    pairs = [(qual, node, name) for qual, node in _functions(tree)
             if 4 <= (node.end_lineno or 0) - node.lineno + 1 <= 30
             for name in _renamable(node)]
    rng.shuffle(pairs)
    seen: set[str] = set()
    first = [p for p in pairs if p[0] not in seen and not seen.add(p[0])]  # type: ignore[func-returns-value]
    chosen = (first + [p for p in pairs if p not in first])[:count]
    chosen.sort(key=lambda p: (p[1].lineno, p[2]))
    out = []
    for qual, node, old in chosen:
        new = f"{old}_{rng.choice(RENAME_WORDS)}"
        before = _segment(lines, node)
        out.append(Edit(path, qual, old, new, before, rename(before, old, new)))
    return out


def _tool_id(seed: int, session: int, turn: int) -> str:
    return "toolu_" + hashlib.sha256(f"{seed}/{session}/{turn}".encode()).hexdigest()[:24]


def answer_text(edit: Edit) -> str:
    """The recorded assistant answer of an edit turn."""
    return (f"Here is `{edit.qual}` with `{edit.old}` renamed to `{edit.new}`:\n\n"
            f"```python\n{edit.after.rstrip()}\n```")


def build_session(spec: TraceSpec, index: int, files: list[str]) -> Session:
    """One session's requests: a file is read on the turns that split ``turns`` evenly."""
    rng = random.Random(f"{spec.seed}/{index}")
    texts = {f: read_source(f, spec.max_file_chars) for f in files}
    reads = {k * spec.turns // len(files): f for k, f in enumerate(files)}
    plan: list[tuple[int, str]] = []  # (turn, file) of each edit
    for k in range(spec.turns):
        plan.append((k, reads.get(k) or plan[-1][1]))
    session = Session(index=index, files=[f"Lib/{f}.py" for f in files])
    per_file = {f: edits_for(f"Lib/{f}.py", texts[f], rng, sum(1 for _, g in plan if g == f))
                for f in files}
    messages: list[dict[str, Any]] = []
    for k, f in plan:
        edit = per_file[f].pop(0) if per_file[f] else None
        if edit is None:  # a file with fewer short functions than turns: ask for a summary
            edit = Edit(f"Lib/{f}.py", "", "", "", "", "")
        ask = (INSTRUCTIONS[rng.randrange(len(INSTRUCTIONS))].format(**asdict(edit))
               if edit.qual else f"Summarize what `Lib/{f}.py` does in three sentences.")
        if k in reads:
            tid = _tool_id(spec.seed, index, k)
            messages += [
                {"role": "user", "content": f"I'm working on `Lib/{f}.py`. {ask}"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": f"I'll read `Lib/{f}.py` first."},
                    {"type": "tool_use", "id": tid, "name": "read_file",
                     "input": {"path": f"Lib/{f}.py"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": tid, "content": texts[f]}]}]
        else:
            messages.append({"role": "user", "content": ask})
        session.turns.append(json.loads(json.dumps(messages)))  # a frozen copy
        session.edits.append(edit)
        messages.append({"role": "assistant",
                         "content": answer_text(edit) if edit.qual else
                         f"`Lib/{f}.py` is a small module of the standard library."})
    return session


def build_trace(spec: TraceSpec | None = None) -> AgentTrace:
    """The trace of ``spec``: the same spec and Python give the same requests."""
    spec = spec or TraceSpec()
    order = list(SOURCE_FILES)
    random.Random(spec.seed).shuffle(order)
    sessions = []
    for i in range(spec.sessions):
        files = [order[(i * spec.files_per_session + j) % len(order)]
                 for j in range(spec.files_per_session)]
        sessions.append(build_session(spec, i, files))
    used = sorted({f for s in sessions for f in s.files})
    sources = {p: hashlib.sha256(read_source(Path(p).stem, spec.max_file_chars).encode())
               .hexdigest() for p in used}
    import platform

    return AgentTrace(spec=spec, system="\n\n".join(SYSTEM_SECTIONS[:spec.system_sections]),
                      tools=[dict(t) for t in TOOLS[:spec.tools]], sessions=sessions,
                      sources=sources, python=platform.python_version())


def anthropic_body(trace: AgentTrace, session: int, turn: int, model: str,
                   stream: bool = True) -> dict[str, Any]:
    """The ``/v1/messages`` request of ``turn`` of ``session`` (greedy)."""
    body: dict[str, Any] = {"model": model, "max_tokens": trace.spec.max_tokens,
                            "temperature": 0.0, "system": trace.system,
                            "messages": trace.sessions[session].turns[turn], "stream": stream}
    if trace.tools:
        body["tools"] = trace.tools
    return body
