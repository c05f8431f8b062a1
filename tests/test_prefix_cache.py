"""Prefix cache: reuse is exact, reported as cached_tokens, and survives unload/reload."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from mlxd.config import ServerConfig
from tests.helpers.server import running_server

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be precise." for i in range(60))


def chat(http: httpx.Client, messages: list[dict], **kw: object) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                "max_tokens": 16, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_cached_and_uncached_prefixes_give_the_same_tokens(tiny_model_b: Path,
                                                           tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "second"}]
    # A home of its own: servers save their prefix cache at shutdown, and this test
    # needs the warm server to start cold.
    cold_cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m",
                            home=tmp_path / "home", no_starter=True, prefix_cache_bytes=0)
    with running_server(cold_cfg) as srv, srv.client() as http:
        cold = [chat(http, msgs), chat(http, other)]
        assert [cached(c) for c in cold] == [0, 0]
    warm_cfg = cold_cfg.model_copy(update={"prefix_cache_bytes": 64 * 2**20})
    with running_server(warm_cfg) as srv, srv.client() as http:
        first = chat(http, msgs)
        second = chat(http, other)  # shares the long system prompt
        again = chat(http, msgs)  # exact repeat
    assert cached(first) == 0
    assert cached(second) > 0.8 * first["usage"]["prompt_tokens"]
    assert cached(again) == again["usage"]["prompt_tokens"] - 1
    for warm, reference in ((first, cold[0]), (second, cold[1]), (again, cold[0])):
        assert warm["choices"][0]["message"]["content"] == \
            reference["choices"][0]["message"]["content"]


def test_multi_turn_conversation_reuses_previous_turns(tiny_model_b: Path,
                                                        test_home: Path) -> None:
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=test_home,
                       no_starter=True)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    with running_server(cfg) as srv, srv.client() as http:
        previous_prompt = 0
        for turn in range(5):
            messages.append({"role": "user", "content": f"question number {turn}"})
            resp = chat(http, messages)
            if turn:
                # Everything up to the previous answer came from the cache.
                assert cached(resp) >= previous_prompt
            previous_prompt = resp["usage"]["prompt_tokens"]
            messages.append({"role": "assistant",
                             "content": resp["choices"][0]["message"]["content"]})


def test_prefix_cache_survives_unload_and_reload(tiny_model_b: Path, tmp_path: Path) -> None:
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=tmp_path / "home",
                       no_starter=True)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "persist"}]
    with running_server(cfg) as srv, srv.client() as http:
        before = chat(http, msgs)
        assert http.post("/v1/models/unload", json={"model": "m"}).json()["unloaded"]
        assert list((tmp_path / "home" / "prefix-cache" / "m").glob("*.safetensors"))
        after = chat(http, msgs)
        assert srv.ctx.manager.get("m").loads == 2
    assert cached(before) == 0
    assert cached(after) == after["usage"]["prompt_tokens"] - 1
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]


def test_cached_entries_hold_only_their_own_bytes(tiny_model_b: Path, test_home: Path) -> None:
    """Entries extracted from a running batch must not pin the batch's whole KV buffer."""
    import concurrent.futures as cf

    import mlx.core as mx

    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=test_home,
                       no_starter=True)
    with running_server(cfg) as srv, srv.client() as http:
        chat(http, [{"role": "user", "content": "warm up"}])
        engine = srv.ctx.manager.get("m").engine
        baseline = mx.get_active_memory() - engine.prefix_cache.nbytes
        prompts = [[{"role": "user", "content": f"{i} " + "word " * 300}] for i in range(12)]
        with cf.ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda m: chat(http, m, max_tokens=40), prompts))
        deadline = time.monotonic() + 30  # the last answers' entries are stored after them
        while not engine.scheduler.settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        held = mx.get_active_memory() - baseline
        cached = engine.prefix_cache.nbytes
    assert cached > 0
    assert held <= 1.5 * cached + 8 * 2**20


def test_an_answer_is_delivered_before_its_states_are_stored(tiny_model_b: Path,
                                                            tmp_path: Path) -> None:
    """Storing a state evaluates a copy of it (tens of ms for a few thousand tokens); the
    client waiting for the answer's end does not wait for that. Storing the answer's state
    here blocks until the test has the whole answer: were it on the answer's path, the
    request would time out. It is stored afterwards, and the next turn resumes from it."""
    cfg = ServerConfig(model=str(tiny_model_b), served_model_name="m", home=tmp_path / "home",
                       no_starter=True)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
    with running_server(cfg) as srv, srv.client() as http:
        chat(http, [{"role": "user", "content": "load"}], max_tokens=1)
        engine = srv.ctx.manager.get("m").engine
        # the warm-up's own answer state is stored after its response: let it land first,
        # or the patched insert below would take it for this request's prompt state
        deadline = time.monotonic() + 30
        while not engine.scheduler.settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        cache = engine.prefix_cache
        answered = threading.Event()
        stored: list[int] = []
        insert = cache.insert

        def insert_after_the_answer(tokens: list[int], *args: object) -> None:
            if stored:  # the prompt's state is stored first, then the answer's
                assert answered.wait(30), "the answer's state was stored before its end"
            insert(tokens, *args)  # type: ignore[arg-type]
            stored.append(len(tokens))

        cache.insert = insert_after_the_answer  # type: ignore[method-assign]
        r = http.post("/v1/chat/completions", timeout=20, json={
            "model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        answered.set()
        prompt = r.json()["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 30
        while len(stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # restored only now: the answer's state may be stored after the response arrives
        cache.insert = insert  # type: ignore[method-assign]
        # the prompt's state, then the answer's (prompt and all but the last token)
        assert stored == [prompt, prompt + 7], stored
        again = chat(http, [*msgs, {"role": "assistant",
                                    "content": r.json()["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "second"}])
        assert cached(again) >= prompt
