"""What the server bench (``bench.server``) sends and aims at: its settings per group, its
models, the conversation and requests built to exact token counts (:func:`make_plan`), the
targets. The runner (``bench.server``) and the report (``bench.server_report``) both read it."""
from __future__ import annotations

from dataclasses import dataclass

from mlx_bricks.bench import user_models as um
from mlx_bricks.bench.user_path import GPU_MAX_TOKENS

SIDES = ("stock", "bricks")
#: Seconds between two nvidia-smi polls.
POLL_S = 0.5
#: The issue's targets: TTFT of each turn, stock / bricks, at least this (by model name); the
#: bricks server's peak memory at most stock's plus this many MiB.
TTFT_TARGETS = {"llama3_8b_q4": 2.5, "qwen35_35b_a3b_q4": 10.0}
MEMORY_TARGET_MIB = 256


@dataclass(frozen=True)
class Settings:
    """What one model's run asks of the servers (token counts are exact where marked).

    Attributes:
        turns: context tokens after each user turn (exact; ascending).
        system_tokens: the system prompt's tokens (exact, with its template).
        max_tokens: tokens generated per request.
        concurrent: requests sent at once.
        concurrent_tokens: tokens of each concurrent request (exact; ``Request i:`` differs).
        warmup_tokens: the warm-up requests' prompt tokens, per server before any timing.
    """

    turns: tuple = (8192, 12288, 16384, 24576, 32768)
    system_tokens: int = 1024
    max_tokens: int = GPU_MAX_TOKENS
    concurrent: int = 4
    concurrent_tokens: int = 2048
    warmup_tokens: tuple = (64, 2240)

    def check(self) -> None:
        """Raises ValueError: a count below 1, turns not ascending or not above the system
        prompt."""
        for name in ("system_tokens", "max_tokens", "concurrent", "concurrent_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        t = list(self.turns)
        if not t or any(isinstance(x, bool) or not isinstance(x, int) for x in t) or \
                t != sorted(set(t)) or t[0] <= self.system_tokens:
            raise ValueError(f"turns must be ascending ints above system_tokens "
                             f"({self.system_tokens}), got {self.turns!r}")


GPU_SETTINGS = Settings()
CPU_SETTINGS = Settings(turns=(192, 384), system_tokens=48, max_tokens=4,
                        concurrent=2, concurrent_tokens=96, warmup_tokens=(32,))
#: The GPU group's models (``bench.user_path.GPU_MODELS``), in the order they run.
GPU_SERVER_MODELS = ("llama3_8b_q4", "qwen35_35b_a3b_q4", "gpt_oss_20b_mxfp4")
#: The CPU group's models.
CPU_SERVER_MODELS = {um.TINY_LLAMA.name: um.TINY_LLAMA}
#: Seconds a model needs before the budget ends to be started at all (writing it, starting and
#: warming both servers: the phases that cannot be skipped once begun), by group.
MODEL_START_S = {"cpu": 0.0, "gpu": 200.0}


# --- the requests -------------------------------------------------------------------------------

def chat_tokens(tokenizer, messages: list, generation_prompt: bool = True) -> list[int]:
    """The prompt ids ``mlx_lm.server`` 0.32 makes of a chat request (its chat template,
    ``tokenize=True``; the generation prompt after a user turn)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                              tokenize=True))


def reply_token(tokenizer, n: int) -> tuple[int, str]:
    """A token id whose ``n``-fold text re-tokenizes, inside the chat template's assistant
    turn, to the same ``n`` ids (digits do in byte-level BPE tokenizers), and that text.

    Raises:
        ValueError: no candidate does.
    """
    ask = [{"role": "user", "content": "x"}]
    base = chat_tokens(tokenizer, ask)
    for cand in ("1", "7", "0", " the", "the"):
        ids = tokenizer.encode(cand, add_special_tokens=False)
        if len(ids) != 1:
            continue
        text = tokenizer.decode(ids * n)
        full = chat_tokens(tokenizer, [*ask, {"role": "assistant", "content": text},
                                       {"role": "user", "content": "y"}])
        if full[:len(base) + n] == base + ids * n:
            return ids[0], text
    raise ValueError("tokenizer: no one-token reply re-tokenizes to itself in the chat template")


@dataclass
class Plan:
    """One model's requests, fixed before any server starts (both sides send the same)."""

    system: str
    users: list
    reply: str
    reply_id: int
    concurrent: list
    warmups: list

    def history(self, turn: int) -> list[dict]:
        """What precedes turn ``turn`` (0-based): system, the earlier turns, each with the
        forced reply."""
        out = [{"role": "system", "content": self.system}]
        for u in self.users[:turn]:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": self.reply}]
        return out

    def messages(self, turn: int) -> list[dict]:
        """The chat request of turn ``turn``: :meth:`history` and this turn's user message."""
        return self.history(turn) + [{"role": "user", "content": self.users[turn]}]


def make_plan(tokenizer, s: Settings) -> Plan:
    """The texts of :class:`Settings`' exact token counts (``bench.user_path.make_prompt`` with
    the server's count of the whole conversation).

    Raises:
        ValueError: bad settings, or a count the template cannot reach exactly.
    """
    s.check()
    rid, reply = reply_token(tokenizer, s.max_tokens)

    def counter(prefix, head=""):
        return lambda tok, text: len(chat_tokens(tok, [*prefix, {"role": "user",
                                                                "content": head + text}]))

    system = um.make_prompt(tokenizer, s.system_tokens, lambda tok, text: len(chat_tokens(
        tok, [{"role": "system", "content": text}], generation_prompt=False)))
    plan = Plan(system, [], reply, rid, [], [])
    for i, target in enumerate(s.turns):
        plan.users.append(um.make_prompt(tokenizer, target, counter(plan.history(i))))
    for i in range(s.concurrent):
        head = f"Request {i + 1}: "
        plan.concurrent.append(head + um.make_prompt(tokenizer, s.concurrent_tokens,
                                                     counter([], head)))
    plan.warmups = [um.make_prompt(tokenizer, w, counter([])) for w in s.warmup_tokens]
    return plan
