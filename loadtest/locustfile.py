"""Locust workloads for KVGate: the request patterns that prefix (KV) reuse exists for.

Four user classes hit the OpenAI API with streaming requests (`stream: true` and
`stream_options.include_usage`), one tenant key per user, round-robin over `--kv-keys`:

- `SharedSystemPromptUser` (`shared-system`): chat, one long system prompt shared by every
  request, then a short question that differs each time;
- `MultiTurnUser` (`multi-turn`): chat conversations that grow turn by turn (the assistant's
  reply and a new user message are appended), restarted after `--kv-max-turns` turns;
- `DocumentQAUser` (`document-qa`): completions over one of a few long "hot" documents plus a
  question;
- `UniquePromptUser` (`unique`): completions whose prompts share nothing (the control).

Each request is reported twice in locust's statistics: as `POST <workload>` with the time until
the stream ended, and as `TTFT <workload>` with the time until the first generated token (the
chat role chunk, sent before any token is computed, does not count). The prompt and cached token
counts from `usage.prompt_tokens_details` (`cached_tokens`, and KVGate's `cached_tokens_per_tier`)
are summed per workload; at the end the hit rates are printed and, with `--kv-report FILE`,
written as JSON.

Every `--kv-*` option also reads an environment variable (`KVGATE_KEYS`, `KVGATE_MODEL`, ...).
locust's own `--help` cannot list them (it is printed before this file loads):
`python loadtest/locustfile.py` prints them, and loadtest/README.md has the table. All text is
made of seeded pseudo-random words, so two runs with the same options send the same prompts in
the same order per user.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from locust import HttpUser, events, tag, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import WorkerRunner
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

logger = logging.getLogger("kvgate.loadtest")

WORKLOADS = {
    "shared-system": "SharedSystemPromptUser",
    "multi-turn": "MultiTurnUser",
    "document-qa": "DocumentQAUser",
    "unique": "UniquePromptUser",
}

_WORDS = """
time people water words number sound place years thing sentence great think where help through
much before line right means old any same tell boy follow came want show also around form three
small set put end does another well large must big even such because turn here why ask went men
read need land different home move try kind hand picture again change off play spell air away
animal house point page letter mother answer found study still learn should world high every near
add food between own below country plant last school father keep tree never start city earth eye
light thought head under story saw left few while along might close something seem next hard open
example begin life always those both paper together got group often run important until children
side feet car mile night walk white sea began grow took river four carry state once book hear stop
without second later miss idea enough eat face watch far real almost let above girl sometimes
mountain cut young talk soon list song being leave family body music color stand sun question fish
area mark dog horse birds problem complete room knew since ever piece told usually friends easy
heard order red door sure become top ship across today during short better best however low hours
black products happened whole measure remember early waves reached listen wind rock space covered
fast several hold himself toward five step morning passed vowel true hundred against pattern
numeral table north slowly money map farm pulled draw voice seen cold cried plan notice south sing
war ground fall king town unit figure certain field travel wood fire upon done english road half
ten fly gave box finally wait correct oh quickly person became shown minutes strong verb stars
front feel fact inches street decided contain course surface produce building ocean class note
nothing rest carefully scientists inside wheels stay green known island week less machine base ago
stood plane system behind ran round boat game force brought understand warm common bring explain
dry though language shape deep thousands yes clear equation yet government filled heat full hot
check object bread rule among noun power cannot able six size dark ball material special heavy fine
pair circle include built
""".split()


@dataclass(frozen=True)
class Settings:
    """The workload knobs (`--kv-*` options, each defaulting to its `KVGATE_*` variable)."""

    keys: tuple[str, ...] = ()
    model: str = ""
    max_tokens: int = 8
    system_words: int = 300
    doc_words: int = 600
    docs: int = 3
    question_words: int = 12
    turn_words: int = 40
    max_turns: int = 6
    unique_words: int = 300
    seed: int = 0
    wait_s: float = 0.5
    report: str = ""

    @classmethod
    def from_options(cls, options: Any) -> Settings:
        if options is None:
            return cls()
        keys = tuple(k.strip() for k in (options.kv_keys or "").split(",") if k.strip())
        return cls(keys=keys, model=options.kv_model or "", max_tokens=options.kv_max_tokens,
                   system_words=options.kv_system_words, doc_words=options.kv_doc_words,
                   docs=options.kv_docs, question_words=options.kv_question_words,
                   turn_words=options.kv_turn_words, max_turns=options.kv_max_turns,
                   unique_words=options.kv_unique_words, seed=options.kv_seed, wait_s=options.kv_wait_s,
                   report=options.kv_report or "")


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    defaults = Settings()

    def add(name: str, env: str, kind: type, default: Any, text: str, **extra: Any) -> None:
        parser.add_argument(name, type=kind, env_var=env, default=default,
                           help=f"{text} (env {env}; default {default!r})", **extra)

    add("--kv-keys", "KVGATE_KEYS", str, "", "comma-separated tenant API keys, one per user in turn; "
        "empty = no Authorization header", is_secret=True)
    add("--kv-model", "KVGATE_MODEL", str, "", "model name; empty = the first id of /v1/models")
    add("--kv-max-tokens", "KVGATE_MAX_TOKENS", int, defaults.max_tokens, "max_tokens of every request")
    add("--kv-system-words", "KVGATE_SYSTEM_WORDS", int, defaults.system_words,
        "words in the shared system prompt")
    add("--kv-doc-words", "KVGATE_DOC_WORDS", int, defaults.doc_words, "words in each hot document")
    add("--kv-docs", "KVGATE_DOCS", int, defaults.docs, "number of hot documents")
    add("--kv-question-words", "KVGATE_QUESTION_WORDS", int, defaults.question_words,
        "words in each question")
    add("--kv-turn-words", "KVGATE_TURN_WORDS", int, defaults.turn_words,
        "words in each user turn of a conversation")
    add("--kv-max-turns", "KVGATE_MAX_TURNS", int, defaults.max_turns, "turns before a conversation restarts")
    add("--kv-unique-words", "KVGATE_UNIQUE_WORDS", int, defaults.unique_words,
        "words in each unique (control) prompt")
    add("--kv-seed", "KVGATE_SEED", int, defaults.seed, "seed of every generated text")
    add("--kv-wait-s", "KVGATE_WAIT_S", float, defaults.wait_s,
        "think time: each user waits uniform(0, this) seconds between requests")
    add("--kv-report", "KVGATE_REPORT", str, "", "write the per-workload token counts as JSON here")


# ---------------------------------------------------------------------------------------------
# Deterministic text


def make_words(rng: random.Random, count: int) -> str:
    """`count` words drawn with `rng`, in sentences of 6 to 14 words."""
    out: list[str] = []
    sentence = 0
    for _ in range(count):
        word = _WORDS[int(len(_WORDS) * rng.random())]
        out.append(word.capitalize() if sentence == 0 else word)
        sentence += 1
        if sentence >= 6 + int(9 * rng.random()):
            out[-1] += "."
            sentence = 0
    return " ".join(out)


def shared_text(seed: int, label: str, count: int) -> str:
    """The same text for every user and run with the same seed and label."""
    return make_words(random.Random(f"{seed}:{label}"), count)


# ---------------------------------------------------------------------------------------------
# Token accounting (per process; workers send theirs to the master)


@dataclass
class Tally:
    """Sums over a workload's successful requests."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)  # cached tokens per tier that served them

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        for tier, tokens in other.tier_tokens.items():
            self.tier_tokens[tier] = self.tier_tokens.get(tier, 0) + tokens

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


TALLIES: dict[str, Tally] = defaultdict(Tally)


def record_usage(workload: str, usage: dict[str, Any]) -> None:
    details = usage.get("prompt_tokens_details") or {}
    tiers = details.get("cached_tokens_per_tier") or {}
    TALLIES[workload].add(Tally(1, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
                                int(usage.get("completion_tokens", 0)),
                                {str(k): int(v) for k, v in tiers.items() if isinstance(v, int)}))


def tally_report() -> dict[str, Any]:
    """JSON-ready totals per workload and overall, with hit rates (cached / prompt tokens)."""
    total = Tally()
    workloads: dict[str, Any] = {}
    for name in sorted(TALLIES):
        total.add(TALLIES[name])
        workloads[name] = {**asdict(TALLIES[name]), "hit_rate": TALLIES[name].hit_rate}
    return {"workloads": workloads, "total": {**asdict(total), "hit_rate": total.hit_rate}}


@events.report_to_master.add_listener
def _send_tallies(client_id: str, data: dict[str, Any]) -> None:
    data["kvgate_tallies"] = {name: asdict(t) for name, t in TALLIES.items()}
    TALLIES.clear()


@events.worker_report.add_listener
def _merge_tallies(client_id: str, data: dict[str, Any]) -> None:
    for name, fields in data.get("kvgate_tallies", {}).items():
        TALLIES[name].add(Tally(**fields))


@events.quitting.add_listener
def _write_report(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    report = tally_report()
    for name, row in report["workloads"].items():
        rate = "n/a" if row["hit_rate"] is None else f"{row['hit_rate']:.1%}"
        logger.info("kvgate %-14s %5d requests  %8d prompt tokens  %8d cached  hit rate %s",
                    name, row["requests"], row["prompt_tokens"], row["cached_tokens"], rate)
    path = Settings.from_options(environment.parsed_options).report
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    _write_final_csv(environment)


def _write_final_csv(environment: Environment) -> None:
    """Write `<--csv>_stats.csv` once more with the final figures.

    Locust rewrites it once a second, so the requests that finish in the last second (and during
    `--stop-timeout`) can be missing from it; every user has stopped by now, so this is final.
    """
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_stats.csv", "w", newline="") as handle:
            StatsCSV(environment, PERCENTILES_TO_REPORT).requests_csv(csv.writer(handle))


# ---------------------------------------------------------------------------------------------
# Users

_user_numbers: dict[str, itertools.count[int]] = defaultdict(itertools.count)
_model_cache: dict[str, str] = {}


class KVGateUser(HttpUser):
    """Base class: a tenant key, a seeded generator, and one streaming request helper."""

    abstract = True
    workload = ""

    def on_start(self) -> None:
        self.settings = Settings.from_options(self.environment.parsed_options)
        self.number = next(_user_numbers[self.workload])  # the n-th user of its class
        self.rng = random.Random(f"{self.settings.seed}:{self.workload}:{self.number}")
        self.headers = {"Content-Type": "application/json"}
        if self.settings.keys:
            self.headers["Authorization"] = f"Bearer {self.key()}"
        self.model = self.settings.model or self._first_model()
        self.sent = 0

    def key(self) -> str:
        """The n-th user of the k-th class gets key n + k (mod the number of keys): every class
        spreads over the tenants, and with one user per class the classes do too."""
        keys = self.settings.keys
        return keys[(self.number + list(WORKLOADS).index(self.workload)) % len(keys)]

    def wait_time(self) -> float:
        return self.rng.uniform(0.0, self.settings.wait_s)

    def _first_model(self) -> str:
        key = self.headers.get("Authorization", "")
        if key not in _model_cache:
            with self.client.get("/v1/models", headers=self.headers, name="/v1/models",
                                 catch_response=True) as response:
                try:
                    _model_cache[key] = response.json()["data"][0]["id"]
                except Exception:
                    response.failure(f"/v1/models: HTTP {response.status_code}: {response.text[:200]}")
                    raise StopUser() from None
        return _model_cache[key]

    def stream(self, path: str, body: dict[str, Any]) -> str | None:
        """POST a streaming request; report TTFT and usage; return the generated text (None on failure)."""
        body = {**body, "model": self.model, "max_tokens": self.settings.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        self.sent += 1
        start = time.perf_counter()
        with self.client.post(path, json=body, headers=self.headers, name=self.workload, stream=True,
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return None
            try:
                text, ttft_s, usage = read_stream(response.iter_lines(), start)
            except Exception as exc:  # a broken stream, an error event or a missing usage chunk
                response.failure(f"stream: {exc}")
                return None
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1000  # type: ignore[index]
            response.success()
        self.environment.events.request.fire(
            request_type="TTFT", name=self.workload, response_time=ttft_s * 1000, response_length=0,
            exception=None, context={})
        record_usage(self.workload, usage)
        return text


def read_stream(lines: Any, start: float) -> tuple[str, float, dict[str, Any]]:
    """Parse an OpenAI SSE stream: (text, seconds to the first token, usage)."""
    text: list[str] = []
    first: float | None = None
    usage: dict[str, Any] | None = None
    for raw in lines:
        if not raw.startswith(b"data: "):
            continue
        data = raw[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"].get("message", "error event"))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            if delta is not None and "role" in delta:
                continue  # the chat role chunk is sent before any token exists
            if first is None:
                first = time.perf_counter() - start
            text.append((delta or {}).get("content") or choice.get("text") or "")
        if chunk.get("usage"):
            usage = chunk["usage"]
    if usage is None:
        raise RuntimeError("no usage chunk")
    return "".join(text), first if first is not None else time.perf_counter() - start, usage


class SharedSystemPromptUser(KVGateUser):
    """Chat: one long system prompt, shared by every request, plus a short new question."""

    workload = "shared-system"

    @tag("shared-system")
    @task
    def ask(self) -> None:
        system = shared_text(self.settings.seed, "system", self.settings.system_words)
        question = f"Question {self.number}.{self.sent}: {make_words(self.rng, self.settings.question_words)}?"
        self.stream("/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": question}]})


class MultiTurnUser(KVGateUser):
    """Chat: a conversation that extends its own history, restarted after `max_turns` turns."""

    workload = "multi-turn"

    def on_start(self) -> None:
        super().on_start()
        self.messages: list[dict[str, str]] = []

    @tag("multi-turn")
    @task
    def turn(self) -> None:
        if len(self.messages) >= 2 * self.settings.max_turns:
            self.messages = []
        opening = f"Conversation {self.number}.{self.sent}. " if not self.messages else ""
        self.messages.append({"role": "user", "content": opening + make_words(self.rng, self.settings.turn_words)})
        reply = self.stream("/v1/chat/completions", {"messages": self.messages})
        if reply is None:
            self.messages = []  # start afresh after a failure
        else:
            self.messages.append({"role": "assistant", "content": reply})


class DocumentQAUser(KVGateUser):
    """Completions: a question about one of a few long documents that every user reads."""

    workload = "document-qa"

    @tag("document-qa")
    @task
    def ask(self) -> None:
        which = int(self.settings.docs * self.rng.random())
        document = shared_text(self.settings.seed, f"document-{which}", self.settings.doc_words)
        question = make_words(self.rng, self.settings.question_words)
        self.stream("/v1/completions", {"prompt": f"Document {which}:\n{document}\n\nQuestion: {question}?\nAnswer:"})


class UniquePromptUser(KVGateUser):
    """Completions: prompts that share nothing, not even their first words (no reuse possible)."""

    workload = "unique"

    @tag("unique")
    @task
    def ask(self) -> None:
        prompt = f"Request {self.number}.{self.sent} {make_words(self.rng, self.settings.unique_words)}"
        self.stream("/v1/completions", {"prompt": prompt})


if __name__ == "__main__":  # `python loadtest/locustfile.py`: the --kv-* options, which locust --help omits
    import argparse

    class _OptionsParser(argparse.ArgumentParser):
        def add_argument(self, *args: Any, env_var: str = "", is_secret: bool = False, **kwargs: Any) -> Any:
            return super().add_argument(*args, **kwargs)

    _parser = _OptionsParser(
        prog="locust -f loadtest/locustfile.py",
        description="KVGate's workload options (each also read from the environment variable named), "
                    "on top of locust's own (`locust --help`). User classes: "
                    + ", ".join(f"{cls} ({name})" for name, cls in WORKLOADS.items()) + ".")
    _add_options(_parser)
    _parser.print_help()
