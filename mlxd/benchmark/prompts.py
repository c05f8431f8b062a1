"""Synthetic prompts of roughly N tokens, without a tokenizer.

The load generator is a client of any server, so it cannot count tokens with
the served model's tokenizer. It builds prompts from a list of common,
lower-case English words that byte-level BPE vocabularies (GPT-2, Llama 3,
Qwen, SmolLM2: 32k-150k entries) keep as ONE token each when preceded by a
space. So ``n`` words are about ``n`` tokens; the chat template and the closing
instruction add a few more (``INSTRUCTION_TOKENS``), which we subtract. The
server's own count (``usage.prompt_tokens``) is reported next to the request
so the approximation is visible in every result (on SmolLM2 it is within a few
percent).

A prompt is ``shared prefix words + request-unique words + instruction``. The
shared prefix is the same for every request of a run (seeded by the run's
seed), so a server with a prefix cache can reuse it; with no shared prefix the
unique words come first so nothing but the chat template is shared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common words that are single tokens (with a leading space) in byte-level BPE
# vocabularies. A tuple: module constants stay immutable.
_WORD_TEXT = """
the of and to in is was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give
our under name very through just form great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small
end put home read hand port large spell add even land here must big high such follow act
why ask men change went light kind off need house picture try us again animal point mother
world near build self earth father head stand own page should country found answer school
grow study still learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run while
press close night real life few north open seem together next white children begin got walk
example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base
hear horse cut sure watch color face wood main enough plain girl usual young ready above
ever red list though feel talk bird soon body dog family direct pose leave song measure door
product black short class wind question happen complete ship area half rock order fire south
problem piece told knew pass since top whole king space heard best hour better true during
hundred remember step early hold west ground interest reach fast five sing listen six
table travel less morning ten simple several toward war lay against pattern slow center love
person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

# Tokens the chat template and the closing instruction add to a prompt (about
# 10-50 depending on the template; SmolLM2 adds ~40 with its default system prompt).
INSTRUCTION_TOKENS = 40
INSTRUCTION = "\n\nWrite a long story that uses the words above."
FOLLOW_UP = "Thank you. Now continue the story and use these words too:"


def words(rng: random.Random, n: int) -> str:
    """``n`` random words from ``WORDS`` joined by spaces (about ``n`` tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(0, n)))


@dataclass(frozen=True)
class PromptSpec:
    """How the prompts of one run are shaped.

    Args:
        prompt_tokens: target length of a first-turn prompt, template included.
        shared_prefix_tokens: leading tokens identical across all requests (<= prompt_tokens).
        turn_tokens: length of each follow-up user message in a multi-turn conversation.
        seed: run seed; request ``i`` derives its own words from ``(seed, i)``.
    """

    prompt_tokens: int = 128
    shared_prefix_tokens: int = 0
    turn_tokens: int = 32
    seed: int = 0

    def shared_prefix(self) -> str:
        """The words every request starts with (empty when there is no shared prefix)."""
        n = min(self.shared_prefix_tokens, max(1, self.prompt_tokens - INSTRUCTION_TOKENS))
        return words(random.Random(f"{self.seed}:shared"), n)

    def text(self, index: int) -> str:
        """The first-turn user text of request ``index``."""
        rng = random.Random(f"{self.seed}:request:{index}")
        budget = max(1, self.prompt_tokens - INSTRUCTION_TOKENS)
        shared = min(self.shared_prefix_tokens, budget)
        unique = words(rng, budget - shared)
        head = self.shared_prefix() if shared else ""
        # The request number first makes unshared prompts differ from their first token.
        body = f"{head} {unique}".strip() if shared else f"{index}: {unique}"
        return body + INSTRUCTION

    def follow_up(self, index: int, turn: int) -> str:
        """The user message of turn ``turn`` (2, 3, ...) of conversation ``index``."""
        rng = random.Random(f"{self.seed}:request:{index}:turn:{turn}")
        return f"{FOLLOW_UP} {words(rng, max(1, self.turn_tokens - 12))}."


def first_messages(spec: PromptSpec, index: int) -> list[dict[str, str]]:
    """The chat messages of the first turn of request / conversation ``index``."""
    return [{"role": "user", "content": spec.text(index)}]


def next_turn(messages: list[dict[str, str]], answer: str, spec: PromptSpec, index: int,
              turn: int) -> list[dict[str, str]]:
    """Turn ``turn``'s messages: the previous messages + their answer + a new user message."""
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": spec.follow_up(index, turn)}]
