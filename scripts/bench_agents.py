#!/usr/bin/env python
"""Benchmark: coding-agent sessions against ``mlx-kvcache serve``'s agent routes vs the
baseline users have today (a benchmark, not a test).

Two replayed sessions, each turn re-sending the whole history as the agents do:
  claude  Claude-Code-shaped, Anthropic Messages (``POST /v1/messages``): system text blocks
          whose first line is the per-request ``x-anthropic-billing-header:`` line, a long
          system prompt and tools marked with ``cache_control``, ``tool_use`` /
          ``tool_result`` exchanges, a ``role: "system"`` nudge every few turns and a
          trailing ``<total_tokens>N tokens left</total_tokens>`` system message after every
          user message; ``cache_control`` on the last message.
  codex   Codex-shaped, OpenAI Responses (``POST /v1/responses``): long ``instructions``,
          function tools plus the non-function tools Codex sends (web_search, local_shell,
          custom), developer and environment messages, ``prompt_cache_key``, a
          ``max_output_tokens=1`` probe before the first turn, reasoning items,
          ``function_call`` / ``function_call_output`` exchanges, an occasional developer
          message mid-conversation.
The assistant turns are scripted (a replay of a recorded session), so both contenders see
the same conversation whatever the model answers.

Contenders, both on loopback, the same turn sent to one and then the other (alternating
order):
  ours      ``mlx-kvcache serve`` on the route the agent speaks;
  baseline  stock ``mlx_lm.server`` (``scripts/stock_server.py``) behind the translation
            users put in front of it today (vllm-mlx 0.6, the common proxies): every
            system / developer message hoisted into the leading system message, the
            billing line stripped (as vllm-mlx does; without that, almost nothing is
            reused at all), tool calls and results as chat messages, reasoning dropped.
            It lives in this file only: it is the thing measured against, not a feature.

Per turn and overall (turns after the first): prompt tokens computed ÷ the turn's new
tokens (goal <= 1.1), the share of prompt tokens read from cache (goal >= 0.95), and TTFT
p50 ours ÷ baseline (goal <= 0.3). Models: the embedded SmolLM2-135M, and a small hybrid
(the tests' qwen3_next: gated delta net + attention, 4 layers, random weights, one
character per token).

    python scripts/bench_agents.py            # 24 turns each, a ~3.2k-token prefix
    python scripts/bench_agents.py --quick    # 10 turns, ~1k-token prefix (minutes)
    python scripts/bench_agents.py --only smollm2 --shapes codex
    python scripts/bench_agents.py --fixed-cost   # one request's tokenizing, chat vs agent
    python scripts/bench_agents.py --route-cost   # a cached prompt through each route
    python scripts/bench_agents.py --stock-cost   # short agent-like turns, ours vs stock
    python scripts/bench_agents.py --thinking     # thinking models' tool loops (foresight)
    python scripts/bench_agents.py --clients      # the same with the real claude / codex CLIs

``--thinking``: sessions of a thinking model in tool loops — several tool steps per user
turn, tool results of a few thousand tokens — through the official SDKs on both agent
APIs, thinking on and off, with the chat templates of Qwen3 (its ``last_query_index``:
reasoning kept only after the last user message) and GLM-4.5, on the scripted agent model
(`mlx_kvcache.testing.scripted_model`: it reasons, then calls a tool on cue, from the token
ids its cache holds). Contenders: ours (foresight: the next prompt computed while the
client is busy — the benchmark waits, as a tool run or a reader would, until the server's
foresight settled), ours with ``--no-foresight``, and stock ``mlx_lm.server`` on the chat
route (the only route it serves; a chat client sends no reasoning back). Per user turn:
prompt tokens computed while the client waits ÷ the tokens the turn added (goal <= 1.05),
tokens computed ahead, and how many of those the next request did not read.

``--clients``: the clients users run, headless, installed from npm into a folder outside
the repository (``--npm DIR``; `bench_agent_clients` drives them): the real ``claude``
(plain, with two parallel subagents, with two forks), ``codex``, ``opencode`` (chat route
and its Anthropic provider) and ``qwen`` CLIs, on the scripted model calling their own
tools on files of 3,000 characters (or ``Agent`` twice in one answer, each subagent then
reading a file), Qwen3's template thinking on or off (``--thinking-modes``), against ours
with and without foresight, stock ``mlx_lm.server`` (chat-route clients) and, with
``--vllm-mlx DIR``, vllm-mlx 0.6 (installed into the virtual environment ``DIR`` when it
is not there yet: it pulls torch, several GB; served with its continuous batching and
prefix cache, its qwen3 tool-call and reasoning parsers). Every request goes through a
recording proxy (`mlx_kvcache.testing.agent_replay`); afterwards the session's requests
are replayed one at a time to ``mlx-kvcache serve --no-foresight`` with
``MLX_KVCACHE_REQUEST_LOG`` set, which logs each one's prompt and answer token ids, and
the cache-perfect reference is computed from them (per request: the prompt less its
longest prefix shared with any earlier request's prompt + answer). Reported per request
class (main loop, subagent — Claude Code's ``x-claude-code-agent-id`` —, side: no tools):
prompt tokens computed ÷ the perfect reference; per turn, the main loop's tokens computed
while the client waits ÷ its new tokens. Live counts come from each answer's usage
(vllm-mlx: its log's ``[cache_fetch]`` lines, in order); between turns the benchmark waits
for ours' foresight to settle (a person reading the answer). The recorded requests are
kept beside the logs (``*_requests.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx_kvcache  # noqa: F401  (before mlx: preloads a fast BLAS)

from mlx_kvcache.testing import write_model_dir  # noqa: E402
from mlx_kvcache.testing.agent_sessions import Session  # noqa: E402
from mlx_kvcache.testing.agent_templates import write_scripted_dir  # noqa: E402
from mlx_kvcache.testing.servers import Server, stop_servers_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_server  # noqa: E402  (its stock server, model, request and percentile helpers)
from bench_agent_clients import CLIENTS as _CLIENT_DRIVERS  # noqa: E402

CLIENT_NAMES = tuple(_CLIENT_DRIVERS)
from bench_server import pct, smollm2_dir, text  # noqa: E402

BILLING = "x-anthropic-billing-header:"


# -- the sessions ----------------------------------------------------------------------------
def tool_specs(rng: random.Random, n: int, words: int) -> List[Dict[str, Any]]:
    """(name, description, JSON schema) of ``n`` tools, each described in ``words`` words."""
    out = []
    for k in range(n):
        out.append({"name": f"tool_{k}", "description": text(rng, words),
                    "schema": {"type": "object", "properties": {
                        "path": {"type": "string", "description": text(rng, 8)},
                        "query": {"type": "string", "description": text(rng, 8)}},
                        "required": ["path"]}})
    return out


class Shape:
    """One scripted session: ``request(turn)`` is the turn's request body for ours,
    ``baseline(turn)`` the chat messages and tools the baseline translation sends, and
    ``advance(turn)`` appends the scripted answer and what follows it."""

    def __init__(self, seed: int, prefix_words: int, tool_words: int, result_words: int):
        self.rng = random.Random(seed)
        self.result_words = result_words
        self.system = ("You are a coding agent working in the user's repository. "
                       + text(self.rng, prefix_words))
        self.tools = tool_specs(self.rng, 12, tool_words)


class ClaudeShape(Shape):
    """Anthropic Messages, as Claude Code sends them."""

    route = "messages"

    def __init__(self, *a):
        super().__init__(*a)
        self.messages: List[Dict[str, Any]] = []
        self._user("Fix the failing test in " + text(self.rng, 20))
        self.calls = 0

    def _user(self, content) -> None:
        self.messages.append({"role": "user", "content": content})
        budget = 200000 - 1500 * len(self.messages)
        self.messages.append({"role": "system",
                              "content": f"<total_tokens>{budget} tokens left</total_tokens>"})

    def request(self, turn: int, max_tokens: int) -> Dict[str, Any]:
        billing = (f"{BILLING} cc_version=2.1.{turn}; cc_entrypoint=cli; "
                   f"cch={uuid.uuid4().hex[:5]};")
        msgs = json.loads(json.dumps(self.messages))
        last = msgs[-1]
        last["content"] = [{"type": "text", "text": last["content"],
                            "cache_control": {"type": "ephemeral"}}] \
            if isinstance(last["content"], str) else last["content"]
        tools = [{"name": t["name"], "description": t["description"],
                  "input_schema": t["schema"]} for t in self.tools]
        tools[-1]["cache_control"] = {"type": "ephemeral"}
        return {"model": "claude-sonnet-5", "max_tokens": max_tokens, "stream": True,
                "system": [{"type": "text", "text": billing},
                           {"type": "text", "text": self.system,
                            "cache_control": {"type": "ephemeral"}}],
                "tools": tools, "messages": msgs,
                "metadata": {"user_id": "user_bench_session_1"}}

    def advance(self, turn: int) -> None:
        self.calls += 1
        cid = f"toolu_{self.calls:04d}"
        tool = self.tools[self.calls % len(self.tools)]["name"]
        self.messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "Let me look at " + text(self.rng, 6) + "."},
            {"type": "tool_use", "id": cid, "name": tool,
             "input": {"path": f"src/{text(self.rng, 1)}.py", "query": text(self.rng, 3)}}]})
        if turn % 3 == 2:  # the user speaks between tool exchanges now and then
            content = [{"type": "tool_result", "tool_use_id": cid,
                        "content": text(self.rng, self.result_words)},
                       {"type": "text", "text": "Also check " + text(self.rng, 10)}]
        else:
            content = [{"type": "tool_result", "tool_use_id": cid, "is_error": turn % 5 == 4,
                        "content": [{"type": "text", "text": text(self.rng, self.result_words)}]}]
        self._user(content)
        if turn % 3 == 1:  # the nudge (every ~7 messages)
            self.messages.append({"role": "system", "content": (
                "The task tools haven't been used recently. Todo list: "
                + text(self.rng, 40))})

    def baseline(self, turn: int):
        """Hoisted: the system prompt then every system message, in one leading message."""
        system = [self.system]
        chat: List[Dict[str, Any]] = []
        for m in self.messages:
            c = m["content"]
            if m["role"] == "system":
                system.append(c)
                continue
            if isinstance(c, str):
                chat.append({"role": m["role"], "content": c})
                continue
            texts = [b["text"] for b in c if b["type"] == "text"]
            if m["role"] == "assistant":
                calls = [{"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b["input"])}}
                    for b in c if b["type"] == "tool_use"]
                chat.append({"role": "assistant", "content": "".join(texts),
                             **({"tool_calls": calls} if calls else {})})
                continue
            for b in c:
                if b["type"] == "tool_result":
                    r = b["content"]
                    r = r if isinstance(r, str) else "".join(x["text"] for x in r)
                    chat.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": r})
            if texts:
                chat.append({"role": "user", "content": "".join(texts)})
        tools = [{"type": "function", "function": {"name": t["name"], "description":
                  t["description"], "parameters": t["schema"]}} for t in self.tools]
        return [{"role": "system", "content": "\n\n".join(system)}] + chat, tools


class CodexShape(Shape):
    """OpenAI Responses, as Codex sends them."""

    route = "responses"

    def __init__(self, *a):
        super().__init__(*a)
        self.key = str(uuid.UUID(int=self.rng.getrandbits(128)))
        self.input: List[Dict[str, Any]] = [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>sandbox: "
                 "workspace-write; approvals: on-request</permissions instructions>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "# AGENTS.md instructions\n" + text(self.rng, 60)}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context><cwd>/repo</cwd>"
                 "<shell>zsh</shell></environment_context>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Fix the failing test in " + text(self.rng, 20)}]},
        ]
        self.calls = 0

    def tool_list(self):
        return [{"type": "function", "name": t["name"], "description": t["description"],
                 "parameters": t["schema"], "strict": False} for t in self.tools] + [
            {"type": "web_search"}, {"type": "local_shell"},
            {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]

    def request(self, turn: int, max_tokens: int) -> Dict[str, Any]:
        return {"model": "gpt-5-codex", "instructions": self.system,
                "input": json.loads(json.dumps(self.input)), "tools": self.tool_list(),
                "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
                "stream": True, "include": ["reasoning.encrypted_content"],
                "prompt_cache_key": self.key, "max_output_tokens": max_tokens}

    def advance(self, turn: int) -> None:
        self.calls += 1
        cid = f"call_{self.calls:04d}"
        self.input.append({"type": "reasoning", "id": f"rs_{self.calls}", "summary": [
            {"type": "summary_text", "text": "Looking at " + text(self.rng, 5)}],
            "encrypted_content": None})
        if turn % 4 == 3:
            self.input.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Progress: " + text(self.rng, 12),
                 "annotations": []}]})
        self.input.append({"type": "function_call", "call_id": cid,
                           "name": self.tools[self.calls % len(self.tools)]["name"],
                           "arguments": json.dumps({"path": f"src/{text(self.rng, 1)}.py"})})
        self.input.append({"type": "function_call_output", "call_id": cid,
                           "output": text(self.rng, self.result_words)})
        if turn % 4 == 3:
            self.input.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Now " + text(self.rng, 10)}]})
        if turn % 7 == 5:  # e.g. the approval mode changed mid-session
            self.input.append({"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>approvals: never"
                 "</permissions instructions>"}]})

    def baseline(self, turn: int):
        system = [self.system]
        chat: List[Dict[str, Any]] = []
        for it in self.input:
            kind = it.get("type")
            if kind == "message":
                t = "".join(p["text"] for p in it["content"])
                if it["role"] in ("system", "developer"):
                    system.append(t)
                elif it["role"] == "assistant":
                    chat.append({"role": "assistant", "content": t})
                else:
                    chat.append({"role": "user", "content": t})
            elif kind == "function_call":
                call = {"id": it["call_id"], "type": "function",
                        "function": {"name": it["name"], "arguments": it["arguments"]}}
                if chat and chat[-1]["role"] == "assistant" and "tool_calls" not in chat[-1]:
                    chat[-1]["tool_calls"] = [call]
                else:
                    chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                chat.append({"role": "tool", "tool_call_id": it["call_id"],
                             "content": it["output"]})
        tools = [{"type": "function", "function": {"name": t["name"], "description":
                  t["description"], "parameters": t["schema"]}} for t in self.tools]
        return [{"role": "system", "content": "\n\n".join(system)}] + chat, tools


SHAPES = {"claude": ClaudeShape, "codex": CodexShape}


# -- one request per contender ---------------------------------------------------------------
_CLIENTS: Dict[tuple, Any] = {}


def sdk_client(route: str, port: int):
    """The official SDK's client for ``route`` on ``port``, made once: making one costs
    0.15–0.4 s on this machine (an SSL context, an HTTP pool), which is the client's, not
    the server's, and must not count in a request's TTFT (the baseline's raw HTTP has
    none)."""
    key = (route, port)
    if key not in _CLIENTS:
        base = f"http://127.0.0.1:{port}"
        if route == "messages":
            import anthropic
            _CLIENTS[key] = anthropic.Anthropic(base_url=base, api_key="local", max_retries=0,
                                                timeout=1800)
        else:
            import openai
            _CLIENTS[key] = openai.OpenAI(base_url=base + "/v1", api_key="local",
                                          max_retries=0, timeout=1800)
    return _CLIENTS[key]


def ask_ours(server: Server, shape: Shape, body: Dict[str, Any]) -> Dict[str, Any]:
    """One streamed request on the agent route, through the official SDK: TTFT (first
    content of any kind), prompt and cached tokens from the answer's usage."""
    client = sdk_client(shape.route, server.port)
    t0 = time.perf_counter()
    ttft = None
    if shape.route == "messages":
        usage: Dict[str, int] = {}
        for ev in client.messages.create(**body):
            if ev.type == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - t0
            if ev.type == "message_start":
                usage.update({k: v for k, v in ev.message.usage.model_dump().items()
                              if isinstance(v, int)})
            elif ev.type == "message_delta" and ev.usage is not None:
                usage.update({k: v for k, v in ev.usage.model_dump().items()
                              if isinstance(v, int)})
        cached = usage.get("cache_read_input_tokens") or 0
        prompt = (usage.get("input_tokens") or 0) + cached
    else:
        final = None
        for ev in client.responses.create(**body):
            if ttft is None and ev.type in ("response.output_text.delta",
                                            "response.reasoning_text.delta",
                                            "response.function_call_arguments.delta"):
                ttft = time.perf_counter() - t0
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert final is not None and final.usage is not None, "no usage in the answer"
        prompt = final.usage.input_tokens
        cached = final.usage.input_tokens_details.cached_tokens
    if ttft is None:
        ttft = time.perf_counter() - t0
    return {"ttft": ttft, "prompt": prompt, "cached": cached}


def ask_baseline(server: Server, shape: Shape, turn: int, max_tokens: int) -> Dict[str, Any]:
    # (the tools are left out: the templates measured here do not render them, so stock
    # mlx-lm would drop them as ours does)
    messages, _ = shape.baseline(turn)
    return bench_server.ask(server, messages, max_tokens, timeout=1800)


# -- a run -------------------------------------------------------------------------------------
def run_shape(name: str, servers: Dict[str, Server], turns: int, max_tokens: int,
              prefix_words: int, tool_words: int, result_words: int) -> Dict[str, List[dict]]:
    shapes = {k: SHAPES[name](7, prefix_words, tool_words, result_words) for k in servers}
    res: Dict[str, List[dict]] = {k: [] for k in servers}
    if name == "codex":  # Codex probes the provider before the first turn
        body = dict(shapes["ours"].request(0, 1))
        ask_ours(servers["ours"], shapes["ours"], body)
        ask_baseline(servers["baseline"], shapes["baseline"], 0, 1)
    for turn in range(turns):
        order = ["baseline", "ours"] if turn % 2 == 0 else ["ours", "baseline"]
        for who in order:
            shape = shapes[who]
            if who == "ours":
                r = ask_ours(servers[who], shape, shape.request(turn, max_tokens))
            else:
                r = ask_baseline(servers[who], shape, turn, max_tokens)
            res[who].append(r)
            shape.advance(turn)
        o, b = res["ours"][-1], res["baseline"][-1]
        print(f"  {name} turn {turn + 1:>2}/{turns}: prompt ours {o['prompt']:>6} "
              f"(cached {o['cached']:>6}), baseline {b['prompt']:>6} (cached {b['cached']:>6}); "
              f"TTFT ours {o['ttft']:.3f} s, baseline {b['ttft']:.3f} s", flush=True)
    return res


def summarize(rs: List[dict]) -> List[dict]:
    """Per turn: computed, new tokens, computed ÷ new, share read from cache."""
    out, prev = [], 0
    for i, r in enumerate(rs):
        new = r["prompt"] - prev if i else r["prompt"]
        computed = r["prompt"] - r["cached"]
        out.append({**r, "new": new, "computed": computed,
                    "ratio": computed / new if new > 0 else float("nan"),
                    "share": r["cached"] / r["prompt"] if r["prompt"] else 0.0})
        prev = r["prompt"]
    return out


def report(title: str, res: Dict[str, List[dict]]) -> Dict[str, float]:
    o, b = summarize(res["ours"]), summarize(res["baseline"])
    print(f"\n  {title}: per turn (computed ÷ new tokens; share read from cache; TTFT s)")
    print(f"  {'turn':>4} {'new':>6} | {'ours c/new':>10} {'share':>6} {'TTFT':>7} | "
          f"{'base c/new':>10} {'share':>6} {'TTFT':>7}")
    for i, (x, y) in enumerate(zip(o, b)):
        print(f"  {i + 1:>4} {x['new']:>6} | {x['ratio']:>10.2f} {x['share']:>6.3f} "
              f"{x['ttft']:>7.3f} | {y['ratio']:>10.2f} {y['share']:>6.3f} {y['ttft']:>7.3f}")

    def overall(rows):
        later = rows[1:]
        new = sum(r["new"] for r in later)
        return {"ratio": sum(r["computed"] for r in later) / new if new else float("nan"),
                "share": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
                "p50": pct([r["ttft"] for r in later], 0.5),
                "mean": sum(r["ttft"] for r in later) / max(1, len(later))}
    a, c = overall(o), overall(b)
    row = {"ours_ratio": a["ratio"], "ours_share": a["share"], "base_ratio": c["ratio"],
           "base_share": c["share"], "ours_p50": a["p50"], "base_p50": c["p50"],
           "ttft_ratio": a["p50"] / c["p50"] if c["p50"] else float("nan"),
           "mean_ratio": a["mean"] / c["mean"] if c["mean"] else float("nan")}
    print(f"  overall, turns 2-{len(o)}: computed ÷ new ours {a['ratio']:.2f} / baseline "
          f"{c['ratio']:.2f} (goal <= 1.1); share from cache ours {a['share']:.3f} / baseline "
          f"{c['share']:.3f} (goal >= 0.95); TTFT p50 ours {a['p50']:.3f} s / baseline "
          f"{c['p50']:.3f} s = {row['ttft_ratio']:.2f} (goal <= 0.3); TTFT mean ours "
          f"{a['mean']:.3f} s / baseline {c['mean']:.3f} s = {row['mean_ratio']:.2f}")
    return row


def models(work: Path, which: List[str]) -> Dict[str, Optional[Path]]:
    out: Dict[str, Optional[Path]] = {}
    if "smollm2" in which:
        out["smollm2"] = smollm2_dir(work)
    if "hybrid" in which:
        # the tests' tiny qwen3_next (4 layers, 64 wide: bench_server's 8 x 256 one takes
        # hours for these sessions on a few CPU cores); 64k positions for the long prompts
        out["hybrid"] = write_model_dir(work / "hybrid", "qwen3_next",
                                        max_position_embeddings=65536)
    return out


#: (system prompt words, words per tool description, words per tool result): the system
#: prompt alone is the long prefix (neither template renders tools). SmolLM2: ~1 token a
#: word here; the hybrid: one token a character (~6.5 a word).
SIZES = {("smollm2", False): (3100, 30, 40), ("smollm2", True): (800, 12, 25),
         ("hybrid", False): (500, 6, 14), ("hybrid", True): (250, 5, 10)}


def fixed_cost(work: Path, words: int = 4200, reps: int = 20) -> None:
    """The tokenizing work of one request (CPU seconds of the thread doing it), one
    ~4.5k-token conversation on SmolLM2's tokenizer: the chat route (mlx-lm's tokenizing:
    the template rendered and encoded, and the leading system messages again for the
    segment split); an agent route rendering and encoding the prompt twice (its layout,
    then mlx-lm's tokenizing: how it was before the layout's ids were handed on); and the
    agent route as it is (the layout, then mlx-lm's tokenizing taking its ids)."""
    import statistics
    import types

    from mlx_lm.server import CompletionRequest, ResponseGenerator
    from mlx_lm.utils import load_tokenizer

    from mlx_kvcache.serving.routes.agents import conversation as cv
    from mlx_kvcache.serving.engine.requests import MarkedRequest

    d = smollm2_dir(work)
    if d is None:
        print("skipped: the embedded SmolLM2 is not installed")
        return
    tok = load_tokenizer(d)
    rng = random.Random(0)
    msgs = [{"role": "system", "content": text(rng, words)},
            {"role": "user", "content": "hello " + text(rng, 300)}]
    gen = types.SimpleNamespace(model_provider=types.SimpleNamespace(
        cli_args=types.SimpleNamespace(chat_template_args={}), processor=None))
    args = types.SimpleNamespace(chat_template_kwargs=None)

    def chat():
        req = CompletionRequest("chat", "", [dict(m) for m in msgs], None, None)
        return ResponseGenerator._tokenize(gen, tok, req, args)

    def agent(hand_on: bool):
        conv = cv.Conversation.from_call(msgs, ["system", "messages[0]"], breakpoints=[(0, 0)])
        conv.fit_template(cv.system_policy(tok, {}))
        lay = cv.layout(tok, conv, None, {})
        req = MarkedRequest("chat", "", conv.messages(), None, None, cuts=lay.cuts,
                            marks=lay.marks, tokens=lay.ids if hand_on else None,
                            template_kwargs={})
        return ResponseGenerator._tokenize(gen, req.tokenizer_for(tok), req, args)

    assert chat()[:2] == agent(False)[:2] == agent(True)[:2]
    print(f"prompt: {len(chat()[0])} tokens; CPU ms per request (median of {reps}):")
    for name, f in (("chat route", chat), ("agent route, rendered twice", lambda: agent(False)),
                    ("agent route, rendered once", lambda: agent(True))):
        ts = []
        for _ in range(reps):
            t0 = time.thread_time()
            f()
            ts.append(time.thread_time() - t0)
        print(f"  {name:28s} {statistics.median(ts) * 1000:6.1f}")


def route_cost(work: Path, rounds: int = 30) -> None:
    """Route against route on one server: the same fully cached ~2.2k-token prompt (the
    tiny hybrid, one token a character) through ``/v1/chat/completions``,
    ``/v1/messages`` and ``/v1/responses``, one token answered, the routes alternating;
    the median wall time of each (raw HTTP: no client library's cost)."""
    import statistics
    import urllib.request

    d = write_model_dir(work / "hybrid", "qwen3_next", max_position_embeddings=65536)
    rng = random.Random(0)
    system, user = text(rng, 330), "hello " + text(rng, 20)
    routes = {
        "chat": ("/v1/chat/completions", {
            "model": "default_model", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}),
        "messages": ("/v1/messages", {"model": "m", "max_tokens": 1, "temperature": 0,
                                      "system": system,
                                      "messages": [{"role": "user", "content": user}]}),
        "responses": ("/v1/responses", {"model": "m", "max_output_tokens": 1, "temperature": 0,
                                        "instructions": system,
                                        "input": [{"role": "user", "content": user}]}),
    }
    with Server([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model", str(d),
                 "--no-persist"], work / "route_cost.log", work / "home") as s:
        def ask(path, body) -> float:
            req = urllib.request.Request(f"http://127.0.0.1:{s.port}{path}",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            urllib.request.urlopen(req, timeout=1800).read()
            return time.perf_counter() - t0

        for path, body in routes.values():  # the first computes the prompt; all warm up
            ask(path, body)
        times: Dict[str, List[float]] = {k: [] for k in routes}
        for _ in range(rounds):
            for k, (path, body) in routes.items():
                times[k].append(ask(path, body))
    print(f"median seconds per request, {rounds} rounds:")
    for k, v in times.items():
        print(f"  {k:10s} {statistics.median(v):.3f}")


def stock_cost(work: Path, rounds: int = 15, serial: bool = False) -> None:
    """Our fixed cost per request against stock's, on the chat route both serve: one
    conversation on the tiny hybrid (a ~2.2k-token system prompt), each round adding an
    assistant answer and a short user message as an agent's turn does (raw HTTP,
    streamed, 4 tokens); the median TTFT of each and, with ``MLX_KVCACHE_PROFILE=1``,
    where the generation thread's time went per request. The servers take the rounds
    alternating, or with ``serial`` each alone, back to back, twice (ours also with
    ``--no-persist``): then what one server does between requests (the disk tier's idle
    capture, its writer) meets the next request as an agent's quick next turn would."""
    import statistics

    d = write_model_dir(work / "hybrid", "qwen3_next", max_position_embeddings=65536)
    env = {"MLX_KVCACHE_PROFILE": "1"}
    commands = {
        "stock": [sys.executable, str(ROOT / "scripts" / "stock_server.py"), "--model", str(d)],
        "ours": [sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model", str(d)]}
    if serial:
        commands["ours --no-persist"] = [sys.executable, "-m", "mlx_kvcache.cli", "serve",
                                         "--model", str(d), "--no-persist"]

    def start(k: str, rep: int = 0) -> Server:
        tag = k.replace(" --", "_").replace("-", "_")
        # each run its own disk cache: a second run must not start from the first's
        cmd = commands[k] + (["--cache-dir", str(work / f"cache_{rep}")] if k == "ours" else [])
        return Server(cmd, work / f"stock_cost_{tag}_{rep}.log", work / "home", env=env)

    def session(ask_all) -> None:
        rng = random.Random(0)
        msgs = [{"role": "system", "content": text(rng, 330)},
                {"role": "user", "content": "hello " + text(rng, 20)}]
        ask_all(msgs, 1, False)  # the first computes the prompt
        for r in range(rounds):
            msgs = msgs + [{"role": "assistant", "content": f"ok {r}"},
                           {"role": "user", "content": "next " + text(rng, 8)}]
            ask_all(msgs, 4, True)

    times: Dict[str, List[float]] = {k: [] for k in commands}
    logs: Dict[str, List[Path]] = {k: [] for k in commands}
    if serial:
        for rep in range(2):
            for k in commands:
                with start(k, rep) as s:
                    def one(msgs, n, timed, s=s, k=k):
                        t = bench_server.ask(s, msgs, n)["ttft"]
                        if timed:
                            times[k].append(t)
                    session(one)
                logs[k].append(s.log)
    else:
        servers = {k: start(k) for k in commands}
        try:
            def each(msgs, n, timed):
                for k, s in servers.items():
                    t = bench_server.ask(s, msgs, n)["ttft"]
                    if timed:
                        times[k].append(t)
            session(each)
        finally:
            for k, s in servers.items():
                s.stop()
                logs[k].append(s.log)
    how = "each server alone, back to back, twice" if serial else "servers alternating"
    print(f"median TTFT of a short agent-like turn, {rounds} rounds, chat route ({how}):")
    for k, v in times.items():
        print(f"  {k:18s} {statistics.median(v):.4f} s (mean {statistics.mean(v):.4f}, n {len(v)})")
    print("generation thread, seconds per request (count):")
    for k, paths in logs.items():
        p = bench_server.rank_profiles(paths[-1].read_text(errors="replace")).get(0)
        if p is None:
            continue
        n = rounds + 1
        rows = sorted(((v / n, key, p.get("counts", {}).get(key, 0))
                       for key, v in p.get("seconds", {}).items()
                       if not key.startswith("cpu.") and v / n >= 2e-4), reverse=True)
        print(f"  {k}: " + ", ".join(f"{key} {v:.4f} ({c})" for v, key, c in rows))


# -- thinking models in tool loops (--thinking) ------------------------------------------------
QUESTIONS = ("Read the notes and sum them up.", "Which one is the longest?",
             "Now compare the first and the last.", "Anything else worth noting?")


def _foresight(server: Server) -> Dict[str, Any]:
    return server.cache().get("foresight") or {}


def _settle(server: Server) -> None:
    """The client's busy time (a tool run, a person reading), as long as the server's
    foresight needs: until it settled (bounded by the server's progress)."""
    server.watch.wait("foresight to settle").until(
        lambda: _foresight(server).get("settled"), poll=0.02)


def _turn_row(requests: List[tuple], prev: int, before: Dict[str, Any],
              after: Dict[str, Any]) -> Dict[str, Any]:
    """One user turn's row from its requests' ``(prompt, cached)``: computed, new (the
    prompt's growth since ``prev``, the last prompt before the turn), computed ahead and
    not read (the foresight counters ``before`` and ``after`` it)."""
    new = computed = 0
    for prompt, cached in requests:
        new += prompt - prev
        computed += prompt - cached
        prev = prompt
    return {"requests": len(requests), "new": new, "computed": computed, "prompt": prev,
            "ahead": after.get("computed_tokens", 0) - before.get("computed_tokens", 0),
            "wasted": after.get("wasted_tokens", 0) - before.get("wasted_tokens", 0)}


def thinking_session(server: Server, api: str, thinking: bool, turns: int, result: int,
                     name: str, foresight: bool) -> List[Dict[str, Any]]:
    """One scripted session; per user turn: computed, new, computed ahead, not read."""
    s = Session(server.port, api, thinking, stream=True, name=name, result_len=result,
                pause=(lambda: _settle(server)) if foresight else None)
    rows, prev = [], 0
    unread = _foresight(server).get("unread_tokens", 0) if foresight else 0
    for t in range(turns):
        before = _foresight(server) if foresight else {}
        n0 = len(s.steps)
        s.turn(QUESTIONS[t % len(QUESTIONS)] + f" (turn {t + 1})")
        after = _foresight(server) if foresight else {}
        rows.append(_turn_row([(st.prompt, st.cached) for st in s.steps[n0:]], prev, before,
                              after))
        prev = rows[-1]["prompt"]
    if foresight:  # what the last answer's foresight computed is never read here
        rows[-1]["wasted"] += _foresight(server).get("unread_tokens", 0) - unread
    return rows


def thinking_bench(work: Path, families: List[str], turns: int, steps: int, result: int) -> None:
    """The ``--thinking`` benchmark (see the module doc)."""
    table = []
    for fam in families:
        d = write_scripted_dir(work / f"scripted_{fam}", fam, steps=steps)
        common = ["--trust-remote-code"]
        servers = {
            "ours": Server([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model", str(d),
                            "--no-persist", *common], work / f"ours_{fam}.log", work / "home"),
            "no-foresight": Server([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model",
                                    str(d), "--no-persist", "--no-foresight", *common],
                                   work / f"nofs_{fam}.log", work / "home"),
            "stock": Server([sys.executable, str(ROOT / "scripts" / "stock_server.py"), "--model",
                             str(d), *common], work / f"stock_{fam}.log", work / "home"),
        }
        try:
            for thinking in (True, False):
                for api in ("anthropic", "responses"):
                    res = {}
                    for who in ("ours", "no-foresight", "stock"):
                        route = "chat" if who == "stock" else api
                        name = f"{fam}-{api}-{'think' if thinking else 'nothink'}-{who}"
                        res[who] = thinking_session(servers[who], route, thinking, turns, result,
                                                    name, foresight=who == "ours")
                    table.append((fam, api, thinking, res))
                    _print_thinking(fam, api, thinking, res)
        finally:
            for sv in servers.values():
                sv.stop()
    print("\n  | template | API | thinking | computed ÷ new, turns 2+: ours | no foresight | "
          "stock (chat) | computed ahead, ours | of it not read | worst turn, ours |")
    print("  | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for fam, api, thinking, res in table:
        o, n, k = (_ratio(res[w][1:]) for w in ("ours", "no-foresight", "stock"))
        worst = max(r["computed"] / r["new"] for r in res["ours"][1:])
        ahead = sum(r["ahead"] for r in res["ours"])
        wasted = sum(r["wasted"] for r in res["ours"])
        print(f"  | {fam} | {api} | {'on' if thinking else 'off'} | {o:.3f} | {n:.3f} | "
              f"{k:.3f} | {ahead} | {wasted} | {worst:.3f} |")


VLLM_MLX = "vllm-mlx==0.6.0"


def vllm_mlx_bin(venv: Path) -> Path:
    """vllm-mlx's command in the virtual environment ``venv`` (made and installed once, with
    the CPU build of the MLX this package runs on)."""
    import subprocess
    import mlx.core as mx
    exe = venv / "bin" / "vllm-mlx"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", VLLM_MLX,
                        f"mlx-cpu=={mx.__version__}"], check=True)
    return exe


def _vllm_requests(log: Path, start: int) -> List[tuple]:
    """``(prompt, cached)`` of each request vllm-mlx logged past byte ``start``."""
    import re
    out = []
    with open(log, "rb") as f:
        f.seek(start)
        for line in f.read().decode(errors="replace").splitlines():
            if "[cache_fetch]" in line:
                p = re.search(r"prompt_tokens=(\d+)", line)
                c = re.search(r"cached=(\d+)", line)
                out.append((int(p.group(1)), int(c.group(1)) if c else 0))
    return out


def _thinking_off(d: Path) -> None:
    """The model directory's template with thinking off whatever the client asks (a
    non-thinking model: the generation prompt carries the empty reasoning block)."""
    off = "{%- set enable_thinking = false %}"
    jinja = d / "chat_template.jinja"  # (where transformers 5 saves it)
    if jinja.exists():
        jinja.write_text(off + jinja.read_text())
    p = d / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    if "chat_template" in cfg:
        cfg["chat_template"] = off + cfg["chat_template"]
        p.write_text(json.dumps(cfg))


def _contender(who: str, d: Path, work: Path, tag: str, vllm: Optional[Path],
               env: Optional[Dict[str, str]] = None, tree: Optional[Path] = None) -> Server:
    """Contender ``who``'s server on the model ``d``; ``tree``: ours from that checkout."""
    log = work / f"{tag}_{who}.log"
    if who == "vllm-mlx":
        return Server([str(vllm), "serve", str(d), "--served-model-name", "local",
                       "--trust-remote-code", "--enable-auto-tool-choice",
                       "--tool-call-parser", "qwen3", "--reasoning-parser", "qwen3",
                       "--continuous-batching", "--enable-prefix-cache"],
                      log, work / "home", env={"HOME": str(work / "vllm_home")})
    if who == "stock":
        return Server([sys.executable, str(ROOT / "scripts" / "stock_server.py"), "--model",
                       str(d), "--trust-remote-code"], log, work / "home")
    extra = ["--no-foresight"] if who in ("no-foresight", "replay") else []
    if tree is not None and who != "replay":  # its package first on the path, not ours
        env = {**(env or {}), "PYTHONPATH": str(tree)}
    return Server([sys.executable, *(["-P"] if tree is not None and who != "replay" else []),
                   "-m", "mlx_kvcache.cli", "serve", "--model", str(d),
                   "--no-persist", "--trust-remote-code", *extra], log, work / "home",
                  env=env)


def _live(who: str, sess: Dict[str, Any]) -> List[Tuple[int, int]]:
    """Per generation request, ``(prompt, cached)`` as the contender counted it (vllm-mlx:
    its log's fetch lines, in order; it reports no cache reads to some clients)."""
    ex = sess["exchanges"]
    if who == "vllm-mlx":
        got = _vllm_requests(sess["log"], 0)
        if len(got) != len(ex):
            print(f"    (vllm-mlx logged {len(got)} fetches for {len(ex)} requests: "
                  f"matched in order)")
        return [got[i] if i < len(got) else (0, 0) for i in range(len(ex))]
    return [e.usage or (0, 0) for e in ex]


def _replay(sess: Dict[str, Any], d: Path, work: Path, tag: str) -> List[int]:
    """The cache-perfect reference of each of the session's generation requests (see
    `agent_replay.perfect`), from a replay to ``mlx-kvcache serve`` that logs token ids."""
    from mlx_kvcache.testing.agent_replay import perfect, replay_ids
    token_log = work / f"{tag}_replay_{len(list(work.glob(f'{tag}_replay_*.jsonl')))}.jsonl"
    server = _contender("replay", d, work, tag + "_replay", None,
                        env={"MLX_KVCACHE_REQUEST_LOG": str(token_log)})
    try:
        ids = replay_ids(sess["exchanges"], server.port, token_log,
                         lambda ready: server.watch.wait("the replay's token log").until(
                             ready, poll=0.02))
    finally:
        server.stop()
    return perfect(ids)


def _turns(sess: Dict[str, Any], live: List[Tuple[int, int]], classes: List[str],
           turn_starts: List[float]) -> List[Dict[str, int]]:
    """Per turn, the main loop's requests: computed while the client waits and new (the
    growth of the main loop's prompt since its last request)."""
    rows, prev = [], 0
    for t, t0 in enumerate(turn_starts):
        t1 = turn_starts[t + 1] if t + 1 < len(turn_starts) else float("inf")
        new = computed = n = 0
        for e, (p, c), k in zip(sess["exchanges"], live, classes):
            if k != "main" or not t0 <= e.started < t1:
                continue
            new += p - prev
            computed += p - c
            prev = p
            n += 1
        rows.append({"requests": n, "new": new, "computed": computed})
    return rows


def clients_bench(work: Path, clients: List[str], turns: int, npm: Path,
                  vllm: Optional[Path] = None, thinking_modes=(True,), stock: bool = True,
                  no_foresight: bool = True, hybrid: bool = False,
                  tree: Optional[Path] = None) -> None:
    """The ``--clients`` benchmark (see the module doc); ``hybrid``: the scripted model
    with its recurrent layer; ``tree``: ours (with and without foresight) served from
    that checkout (the replay's reference stays this one's)."""
    from mlx_kvcache.testing.agent_replay import classify
    from bench_agent_clients import CLIENTS, install_clients, versions
    bins = install_clients(npm)
    for k, v in versions(bins).items():
        print(f"  {k}: {v}")
    notes = work / "project" / "notes"
    notes.mkdir(parents=True)
    rng = random.Random(11)
    files = []
    for k in range(3):
        f = notes / f"part{k + 1}.txt"
        f.write_text(text(rng, 600)[:3000])
        files.append(f)
    summary = []
    for thinking in thinking_modes:
        for name in clients:
            client = CLIENTS[name]
            tag = f"{name}_{'think' if thinking else 'nothink'}{'_hybrid' if hybrid else ''}"
            d = write_scripted_dir(work / f"scripted_{tag}", "qwen3",
                                   step_calls=client.steps(files),
                                   sub_calls=client.sub(files) if client.sub else None,
                                   hybrid=hybrid)
            if not thinking:
                _thinking_off(d)
            who_all = ["ours"] + (["no-foresight"] if no_foresight else []) \
                + (["vllm-mlx"] if vllm is not None else []) \
                + (["stock"] if stock and client.route == "chat" else [])
            print(f"\n  {name}, Qwen3 template, thinking {'on' if thinking else 'off'}"
                  f"{', hybrid model' if hybrid else ''}:", flush=True)
            res = {}
            for who in who_all:
                turn_starts: List[float] = []
                try:
                    sess = _run_turns(client, who, d, work, tag, bins, turns, vllm, turn_starts,
                                      tree)
                    live = _live(who, sess)
                    classes = [classify(e) for e in sess["exchanges"]]
                    ref = _replay(sess, d, work, tag)
                except Exception as e:  # one contender's failure leaves the others' figures
                    print(f"    {name} / {who} failed: {str(e)[-1500:]}", flush=True)
                    if who == "ours":
                        break
                    continue
                res[who] = {"sess": sess, "live": live, "classes": classes, "ref": ref,
                            "turns": _turns(sess, live, classes, turn_starts)}
                _print_session(name, who, res[who])
            if "ours" in res:
                summary.append((name, thinking, res))
    print("\n  per request class: prompt tokens computed ÷ what a cache-perfect server computes "
          "(one request at a time, no foresight, every earlier prompt and answer kept)")
    print("  | client | thinking | class | requests | perfect | " + " | ".join(
        ("ours", "no foresight", "vllm-mlx", "stock")) + " |")
    print("  | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, thinking, res in summary:
        o = res["ours"]
        for k in ("main", "subagent", "side"):
            if k not in o["classes"]:
                continue
            ref = _class_sum(o, k, "ref")
            cells = []
            for who in ("ours", "no-foresight", "vllm-mlx", "stock"):
                r = res.get(who)  # (none of the class: that server refused them, e.g. 400)
                cells.append("-" if r is None or k not in r["classes"] else
                             f"{_class_sum(r, k, 'computed') / max(1, _class_sum(r, k, 'ref')):.3f}")
            print(f"  | {name} | {'on' if thinking else 'off'} | {k} | "
                  f"{o['classes'].count(k)} | {ref} | " + " | ".join(cells) + " |")
    print("\n  per turn, the main loop: computed while the client waits ÷ new tokens, turns 2+")
    print("  | client | thinking | ours | no foresight | vllm-mlx | stock | computed ahead, "
          "ours (not read) |")
    print("  | --- | --- | --- | --- | --- | --- | --- |")
    for name, thinking, res in summary:
        cells = []
        for who in ("ours", "no-foresight", "vllm-mlx", "stock"):
            r = res.get(who)
            cells.append("-" if r is None else f"{_ratio(r['turns'][1:]):.3f}")
        fs = res["ours"]["sess"]["foresight"]
        print(f"  | {name} | {'on' if thinking else 'off'} | " + " | ".join(cells)
              + f" | {fs.get('computed_tokens', 0)} ({fs.get('wasted_tokens', 0)}) |")


def _run_turns(client, who, d, work, tag, bins, turns, vllm, turn_starts,
               tree=None) -> Dict[str, Any]:
    """One client session against contender ``who``, noting each turn's start in
    ``turn_starts``."""
    from mlx_kvcache.testing.agent_replay import Recorder
    from bench_agent_clients import prompt_of
    server = _contender(who, d, work, tag, vllm, tree=tree)
    rec = Recorder(server.port)
    try:
        for t in range(turns):
            t0 = time.time()
            turn_starts.append(t0)
            client.turn(bins, f"http://127.0.0.1:{rec.port}", work / "project",
                        work / f"{tag}_{who}_home",
                        prompt_of(client, QUESTIONS[t % len(QUESTIONS)] + f" (turn {t + 1})"),
                        t == 0, model="default_model" if who == "stock" else "local")
            if who == "ours":
                _settle(server)  # a person reads the answer
            got = [e for e in rec.since(t0) if e.generation]
            print(f"    {tag} {who} turn {t + 1}: {len(got)} requests, "
                  f"{time.time() - t0:.0f} s", flush=True)
        ex = [e for e in rec.exchanges if e.generation]
        fs = _foresight(server) if who == "ours" else {}
    finally:
        rec.close()
        server.stop()
        (work / f"{tag}_{who}_requests.json").write_text(
            json.dumps([e.as_dict() for e in rec.exchanges], indent=1))
    return {"exchanges": ex, "foresight": fs, "log": server.log}


def _class_sum(r: Dict[str, Any], k: str, what: str) -> int:
    total = 0
    for (p, c), cls, ref in zip(r["live"], r["classes"], r["ref"]):
        if cls == k:
            total += ref if what == "ref" else p - c
    return total


def _print_session(name: str, who: str, r: Dict[str, Any]) -> None:
    print(f"    {name} / {who}: per request (class, agent, prompt, computed, perfect)")
    for e, (p, c), cls, ref in zip(r["sess"]["exchanges"], r["live"], r["classes"], r["ref"]):
        agent = e.headers.get("x-claude-code-agent-id", "")[:8]
        print(f"      {e.started % 1000:8.2f} {cls:8s} {agent:8s} prompt {p:>6} computed "
              f"{p - c:>6} perfect {ref:>6}")
    for i, t in enumerate(r["turns"]):
        print(f"      turn {i + 1}: main {t['requests']} req, computed {t['computed']} / new "
              f"{t['new']} = {t['computed'] / max(1, t['new']):.3f}")
    for k in ("main", "subagent", "side"):
        if k in r["classes"]:
            print(f"      {k}: computed {_class_sum(r, k, 'computed')} / perfect "
                  f"{_class_sum(r, k, 'ref')}")


def _ratio(rows: List[Dict[str, Any]]) -> float:
    new = sum(r["new"] for r in rows)
    return sum(r["computed"] for r in rows) / new if new else float("nan")


def _print_thinking(fam: str, api: str, thinking: bool, res: Dict[str, List[dict]]) -> None:
    print(f"\n  {fam}, {api}, thinking {'on' if thinking else 'off'}: per user turn, computed "
          f"while the client waits ÷ new tokens (computed / new)")
    print(f"  {'turn':>4} {'reqs':>4} | {'ours':>20} {'ahead':>6} {'unread':>6} | "
          f"{'no foresight':>20} | {'stock (chat)':>20}")
    for i, (o, n, k) in enumerate(zip(res["ours"], res["no-foresight"], res["stock"])):
        def cell(r):
            return f"{r['computed'] / r['new']:.3f} ({r['computed']}/{r['new']})"
        print(f"  {i + 1:>4} {o['requests']:>4} | {cell(o):>20} {o['ahead']:>6} {o['wasted']:>6} "
              f"| {cell(n):>20} | {cell(k):>20}", flush=True)


def main(argv=None):
    stop_servers_on_sigterm()  # a killed benchmark leaves no server behind
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="10 turns, a ~1k-token prefix (~1.8k on the hybrid), 4-token answers")
    ap.add_argument("--only", nargs="+", choices=("smollm2", "hybrid"),
                    default=["smollm2", "hybrid"])
    ap.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    ap.add_argument("--turns", type=int, default=None, help="turns per session (24; quick 10)")
    ap.add_argument("--fixed-cost", action="store_true",
                    help="only time one request's tokenizing work, chat vs agent route")
    ap.add_argument("--route-cost", action="store_true",
                    help="only time the same cached prompt through each route of one server")
    ap.add_argument("--stock-cost", action="store_true",
                    help="only time short agent-like turns on ours' and stock's chat route")
    ap.add_argument("--serial", action="store_true",
                    help="with --stock-cost: each server alone, back to back (ours also "
                         "with --no-persist), not alternating")
    ap.add_argument("--thinking", action="store_true",
                    help="thinking models in tool loops: ours with and without foresight vs "
                         "stock (see the module doc)")
    ap.add_argument("--families", nargs="+", choices=("qwen3", "glm45"),
                    default=["qwen3", "glm45"], help="with --thinking: the chat templates")
    ap.add_argument("--clients", nargs="*", choices=CLIENT_NAMES, default=None,
                    help="the real CLIs (claude and codex when none is named): ours with and "
                         "without foresight, each request against a cache-perfect replay "
                         "(see the module doc)")
    ap.add_argument("--vllm-mlx", default=None, metavar="VENV",
                    help="with --clients: also vllm-mlx 0.6, from this virtual environment "
                         "(made and installed when missing)")
    ap.add_argument("--npm", default=None, metavar="DIR",
                    help="with --clients: where the CLIs are installed from npm (default: "
                         "bench_agents_clients beside the temporary folder)")
    ap.add_argument("--thinking-modes", nargs="+", choices=("on", "off"), default=["on"],
                    help="with --clients: the scripted model thinking, not thinking, or both")
    ap.add_argument("--no-stock", action="store_true",
                    help="with --clients: leave out stock mlx_lm.server (chat-route clients)")
    ap.add_argument("--no-no-foresight", action="store_true",
                    help="with --clients: leave out ours with --no-foresight")
    ap.add_argument("--hybrid", action="store_true",
                    help="with --clients: the scripted model with a recurrent layer too "
                         "(restored only at checkpoints; a wrong restore changes its answers)")
    ap.add_argument("--server-tree", default=None, metavar="DIR",
                    help="with --clients: serve ours from the checkout DIR (e.g. the code "
                         "before a change); the replay's reference stays this checkout's")
    args = ap.parse_args(argv)
    if args.clients is not None:
        print(f"command: python scripts/bench_agents.py {shlex.join(argv or sys.argv[1:])}")
        work = Path(tempfile.mkdtemp(prefix="bench_agents_"))
        print(f"logs under {work}")
        return clients_bench(work, args.clients or ["claude", "codex"],
                             turns=args.turns or (2 if args.quick else 4),
                             npm=Path(args.npm) if args.npm else
                             work.parent / "bench_agents_clients",
                             vllm=vllm_mlx_bin(Path(args.vllm_mlx)) if args.vllm_mlx else None,
                             thinking_modes=[m == "on" for m in args.thinking_modes],
                             stock=not args.no_stock, no_foresight=not args.no_no_foresight,
                             hybrid=args.hybrid,
                             tree=Path(args.server_tree).resolve() if args.server_tree else None)
    if args.thinking:
        print(f"command: python scripts/bench_agents.py {shlex.join(argv or sys.argv[1:])}")
        work = Path(tempfile.mkdtemp(prefix="bench_agents_"))
        print(f"logs under {work}")
        return thinking_bench(work, args.families, turns=args.turns or (3 if args.quick else 4),
                              steps=2 if args.quick else 3, result=1500 if args.quick else 3000)
    if args.fixed_cost:
        return fixed_cost(Path(tempfile.mkdtemp(prefix="bench_agents_")))
    if args.route_cost:
        return route_cost(Path(tempfile.mkdtemp(prefix="bench_agents_")))
    if args.stock_cost:
        return stock_cost(Path(tempfile.mkdtemp(prefix="bench_agents_")), serial=args.serial)
    turns = args.turns or (10 if args.quick else 24)
    max_tokens = 4 if args.quick else 16
    print(f"command: python scripts/bench_agents.py {shlex.join(argv or sys.argv[1:])}")
    work = Path(tempfile.mkdtemp(prefix="bench_agents_"))
    print(f"logs and caches under {work}")
    rows = {}
    for mname, d in models(work, args.only).items():
        if d is None:
            print(f"{mname} skipped: the embedded SmolLM2 is not installed")
            continue
        words = SIZES[(mname, args.quick)]
        home = work / f"home_{mname}"
        ours = Server([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model", str(d),
                       "--cache-dir", str(work / f"cache_{mname}")],
                      work / f"ours_{mname}.log", home)
        try:
            base = Server([sys.executable, str(ROOT / "scripts" / "stock_server.py"),
                           "--model", str(d)], work / f"baseline_{mname}.log", home)
        except BaseException:  # (a SIGTERM during its start too: no orphaned server)
            ours.stop()
            raise
        servers = {"ours": ours, "baseline": base}
        try:
            for sname in args.shapes:
                print(f"\n{mname}, {sname}-shaped session:", flush=True)
                res = run_shape(sname, servers, turns, max_tokens, *words)
                rows[(mname, sname)] = report(f"{mname}, {sname}", res)
        finally:
            for s in servers.values():
                s.stop()
    print("\n  | model | session | computed ÷ new, ours | baseline | share from cache, ours "
          "| baseline | TTFT p50 ours ÷ baseline | TTFT mean ours ÷ baseline |")
    print("  | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (m, s), r in rows.items():
        print(f"  | {m} | {s} | {r['ours_ratio']:.2f} | {r['base_ratio']:.2f} | "
              f"{r['ours_share']:.3f} | {r['base_share']:.3f} | {r['ttft_ratio']:.2f} "
              f"({r['ours_p50']:.3f} / {r['base_p50']:.3f} s) | {r['mean_ratio']:.2f} |")


if __name__ == "__main__":
    main()
