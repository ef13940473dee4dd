"""Agent sessions from published trajectories of real coding agents (the model's own words, the tool output it saw).

Four published formats, each parsed into our Session model (system, user,
assistant and tool turns; see `sessions` for how they are rendered):

- SWE-agent `.traj`: a JSON object whose `history` is the message list the model
  was sent; assistant messages keep the raw response (`content`) and, in
  function-calling configs, `tool_calls` (OpenAI shape, sometimes stored as a
  Python-repr string).
- mini-swe-agent `.traj.json`: an object with `messages` (and `info.config.model`)
  or, in old releases, a bare message list. Observations are `user` messages in
  the text-action configs and `tool` messages in the tool-call ones.
- OpenHands `output.jsonl`: one evaluation record per line with `history`, a list
  of events. An agent action that carries `tool_call_metadata.model_response`
  is rendered from that response (content, reasoning_content, tool_calls), once
  per response even when it produced several actions; an action without it (old
  CodeAct records) is rendered from its `thought` plus a call named after the
  action with its `args` minus the bookkeeping fields. Observations become tool
  turns; `agent_state_changed` / `null` events are bookkeeping and are dropped.
- Nebius' SWE-agent trajectories (`*.nebius.json`, one row of the
  nebius/SWE-agent-trajectories data set as a JSON object): `trajectory` is the
  message list of a text-action SWE-agent run, with roles `system` (the prompt
  in `system_prompt`), `user` (the task, then every observation, as the model
  was sent them) and `ai` (the model's reply: its reasoning and the command in
  a fenced block). The model is `model_name`.

Files may be gzip-compressed (`.gz`). The session's `source` is the repository
(`repo:owner/name`), taken from a SWE-bench instance id (the record's
`instance_id`, else the file name), else the record (OpenHands `instance.repo`,
resolver `issue.owner/repo`)
(`pydicom__pydicom-1458` -> pydicom/pydicom), so a fit/holdout split by source
never puts one repository on both sides.

A record that cannot be parsed raises a TrajectoryError naming the file and the
record; `load_trajectories` logs it, counts it in LoadStats and goes on.
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.workloads.sessions import Session, ToolCall, Turn

log = logging.getLogger(__name__)

SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "agent"
FORMATS = ("sweagent", "mini", "openhands", "nebius")
_INSTANCE = re.compile(r"^(?P<owner>[A-Za-z0-9_.-]+?)__(?P<name>[A-Za-z0-9_.-]+?)-(?P<num>[A-Za-z0-9]+)$")
_OH_DROPPED_OBS = {"agent_state_changed", "null", "user_rejected"}
_OH_BOOKKEEPING_ARGS = {"thought", "is_input", "blocking", "hidden", "confirmation_state", "impl_source",
                        "security_risk", "kernel_init_code", "include_extra", "is_confirmed", "action", "keep_prompt",
                        "action_risk", "source", "id", "timestamp", "message"}


class TrajectoryError(SlackTierError):
    """A trajectory file or record that cannot be turned into a session."""

    def __init__(self, path: Path | str, record: int | None, reason: str) -> None:
        where = f"{path}" if record is None else f"{path} record {record}"
        super().__init__(ErrorKind.BAD_INPUT, f"{where}: {reason}",
                         fix="re-download the file or drop it from the directory; the other records still load")
        self.path = str(path)
        self.record = record
        self.reason = reason


@dataclass
class LoadStats:
    """What a load saw: files and records read, sessions made, and every record skipped with its reason."""

    files: int = 0
    records: int = 0
    sessions: int = 0
    skipped: list[tuple[str, int | None, str]] = field(default_factory=list)  # (file, record, reason)

    def skip(self, err: TrajectoryError) -> None:
        self.skipped.append((err.path, err.record, err.reason))


def format_of(path: Path) -> str:
    """The published format a file name says it holds ("sweagent" | "mini" | "openhands" | "nebius")."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".nebius.json"):
        return "nebius"
    if name.endswith(".traj.json"):
        return "mini"
    if name.endswith(".traj"):
        return "sweagent"
    if name.endswith(".jsonl"):
        return "openhands"
    raise TrajectoryError(path, None, "not a trajectory file name (.traj, .traj.json, .nebius.json or .jsonl, "
                                      "optionally .gz)")


def _read_text(path: Path) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def repo_of_instance(instance_id: str) -> str | None:
    """The owner/name of a SWE-bench instance id: "pydicom__pydicom-1458" -> "pydicom/pydicom"."""
    m = _INSTANCE.match(instance_id)
    return f"{m['owner']}/{m['name']}" if m else None


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json", ".jsonl", ".traj", ".output", ".nebius"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.split("__", 1)[1] if name.count("__") >= 2 else name


def _text(content) -> str:
    """Message content as text: a string, or OpenAI content parts (text parts joined, others dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError(f"content of type {type(content).__name__}")


def _calls(raw) -> tuple[ToolCall, ...]:
    """OpenAI-shaped tool calls (a list, a JSON string or a Python-repr string, as SWE-agent stores them)."""
    if not raw:
        return ()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raw = ast.literal_eval(raw)
    out = []
    for c in raw:
        fn = c["function"]
        args = fn.get("arguments", "")
        out.append(ToolCall(fn["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return tuple(out)


def _message_turn(m: dict) -> Turn:
    role = m["role"]
    if role == "assistant":
        return Turn("assistant", _text(m.get("content")), reasoning=_text(m.get("reasoning_content")),
                    tool_calls=_calls(m.get("tool_calls")))
    if role in ("system", "user", "tool"):
        return Turn(role, _text(m.get("content")))
    raise ValueError(f"unknown message role {role!r}")


def _finish(turns: list[Turn], path: Path, record: int | None, session_id: str, repo: str | None,
            framework: str, model: str) -> Session:
    if not any(t.role == "assistant" for t in turns):
        raise TrajectoryError(path, record, "no assistant turn")
    while turns[-1].role != "assistant":
        turns.pop()
    return Session(session_id, f"repo:{repo or 'unknown/' + _stem(path)}", "agent", tuple(turns), framework, model)


def parse_sweagent(obj, path: Path) -> Session:
    """A SWE-agent .traj object -> Session (its `history`: the messages the model was sent and wrote)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("history"), list):
        raise TrajectoryError(path, 0, "no `history` list (not a SWE-agent .traj)")
    try:
        turns = [_message_turn(m) for m in obj["history"] if m.get("agent", "primary") in ("primary", "main")]
    except (KeyError, TypeError, ValueError, SyntaxError) as exc:
        raise TrajectoryError(path, 0, f"bad history message: {exc!r}") from exc
    model = ""
    rc = obj.get("replay_config")
    if isinstance(rc, str):
        try:
            rc = json.loads(rc)
        except json.JSONDecodeError:
            rc = None
    if isinstance(rc, dict):
        model = str(((rc.get("agent") or {}).get("model") or {}).get("name", ""))
    if not model and "__" in path.parent.name:
        model = path.parent.name.split("__", 1)[0]
    if not model and "__" in path.name:
        model = path.name.split("__", 1)[0]
    stem = _stem(path)
    return _finish(turns, path, 0, f"sweagent:{stem}", repo_of_instance(stem), "swe-agent", model)


def parse_mini(obj, path: Path) -> Session:
    """A mini-swe-agent .traj.json object (or an old bare message list) -> Session."""
    messages = obj if isinstance(obj, list) else obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list):
        raise TrajectoryError(path, 0, "no `messages` list (not a mini-swe-agent trajectory)")
    try:
        turns = [_message_turn(m) for m in messages if m.get("role") != "exit"]
    except (KeyError, TypeError, ValueError, SyntaxError, AttributeError) as exc:
        raise TrajectoryError(path, 0, f"bad message: {exc!r}") from exc
    model = ""
    if isinstance(obj, dict):
        model = str((((obj.get("info") or {}).get("config") or {}).get("model") or {}).get("model_name", ""))
    stem = _stem(path)
    return _finish(turns, path, 0, f"mini:{stem}", repo_of_instance(stem), "mini-swe-agent", model)


_NEBIUS_ROLES = {"system": "system", "user": "user", "ai": "assistant"}


def parse_nebius(obj, path: Path) -> Session:
    """One row of nebius/SWE-agent-trajectories (a JSON object with `trajectory`) -> Session."""
    if not isinstance(obj, dict) or not isinstance(obj.get("trajectory"), list):
        raise TrajectoryError(path, 0, "no `trajectory` list (not a Nebius SWE-agent trajectory)")
    turns = []
    try:
        for m in obj["trajectory"]:
            role = _NEBIUS_ROLES.get(m["role"])
            if role is None:
                raise ValueError(f"unknown message role {m['role']!r}")
            text = m.get("system_prompt") if role == "system" else None
            turns.append(Turn(role, _text(text if text is not None else m.get("text"))))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TrajectoryError(path, 0, f"bad trajectory message: {exc!r}") from exc
    instance = str(obj.get("instance_id") or _stem(path))
    return _finish(turns, path, 0, f"nebius:{instance}", repo_of_instance(instance), "swe-agent",
                   str(obj.get("model_name", "")))


def _oh_args(event: dict) -> dict:
    """An event's arguments: `args`, or the event itself in old flat records ({"action", "command", "thought"})."""
    return (event.get("args") or {}) if "args" in event else event


def _oh_action_call(event: dict) -> ToolCall:
    args = {k: v for k, v in _oh_args(event).items() if k not in _OH_BOOKKEEPING_ARGS}
    return ToolCall(str(event["action"]), json.dumps(args, ensure_ascii=False))


def parse_openhands(record, path: Path, index: int) -> Session:
    """One OpenHands evaluation record (a line of output.jsonl) -> Session."""
    if not isinstance(record, dict) or not isinstance(record.get("history"), list):
        raise TrajectoryError(path, index, "no `history` list (not an OpenHands output record)")
    turns: list[Turn] = []
    seen_responses: set[str] = set()
    model = str(((record.get("metadata") or {}).get("llm_config") or {}).get("model", ""))
    try:
        for event in record["history"]:
            if isinstance(event, list):  # very old records: [action, observation] pairs
                raise ValueError("paired-event history (pre-2024 OpenHands) is not supported")
            if "observation" in event:
                if event["observation"] in _OH_DROPPED_OBS:
                    continue
                turns.append(Turn("tool", _text(event.get("content"))))
                continue
            action = event.get("action")
            if action is None:
                continue
            source = event.get("source", "agent")
            if action == "system":
                turns.append(Turn("system", _text(_oh_args(event).get("content"))))
            elif source == "user" or (action == "message" and index_is_first_user(turns)):
                turns.append(Turn("user", _text(_oh_args(event).get("content") or event.get("message"))))
            else:
                meta = event.get("tool_call_metadata") or {}
                response = meta.get("model_response")
                if response:
                    rid = str(response.get("id", id(response)))
                    if rid in seen_responses:
                        continue
                    seen_responses.add(rid)
                    msg = response["choices"][0]["message"]
                    model = model or str(response.get("model", ""))
                    turns.append(Turn("assistant", _text(msg.get("content")),
                                      reasoning=_text(msg.get("reasoning_content")),
                                      tool_calls=_calls(msg.get("tool_calls"))))
                elif action in ("message", "finish"):
                    args = _oh_args(event)
                    text = _text(args.get("content") or args.get("final_thought") or args.get("thought")
                                 or event.get("message"))
                    turns.append(Turn("assistant", text))
                else:
                    thought = _text(_oh_args(event).get("thought"))
                    turns.append(Turn("assistant", thought, tool_calls=(_oh_action_call(event),)))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, SyntaxError) as exc:
        raise TrajectoryError(path, index, f"bad event: {exc!r}") from exc
    repo = repo_of_instance(str(record["instance_id"])) if record.get("instance_id") else None
    inst = record.get("instance")
    if repo is None and isinstance(inst, dict) and inst.get("repo"):
        repo = str(inst["repo"])
    if repo is None and isinstance(record.get("issue"), dict) and record["issue"].get("owner"):
        repo = f"{record['issue']['owner']}/{record['issue']['repo']}"
    sid = record.get("instance_id") or (f"{repo}#{record['issue'].get('number')}" if record.get("issue") else index)
    return _finish(turns, path, index, f"openhands:{_stem(path)}:{sid}", repo, "openhands", model)


def index_is_first_user(turns: list[Turn]) -> bool:
    """An unsourced `message` action before any user turn is the task (old records lack `source`)."""
    return not any(t.role == "user" for t in turns)


def iter_file(path: Path, stats: LoadStats | None = None) -> Iterator[Session]:
    """The sessions in one trajectory file; a bad record is logged, counted in `stats` and skipped."""
    stats = stats if stats is not None else LoadStats()
    path = Path(path)
    stats.files += 1
    try:
        fmt = format_of(path)
        text = _read_text(path)
    except TrajectoryError as err:
        stats.skip(err)
        log.warning("%s", err)
        return
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        err = TrajectoryError(path, None, f"unreadable: {exc!r}")
        stats.skip(err)
        log.warning("%s", err)
        return
    if fmt == "openhands":
        items: Iterable[tuple[int, str]] = ((i, line) for i, line in enumerate(text.splitlines()) if line.strip())
    else:
        items = [(0, text)]
    for index, raw in items:
        stats.records += 1
        try:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TrajectoryError(path, index, f"not valid JSON: {exc}") from exc
            if fmt == "sweagent":
                session = parse_sweagent(obj, path)
            elif fmt == "mini":
                session = parse_mini(obj, path)
            elif fmt == "nebius":
                session = parse_nebius(obj, path)
            else:
                session = parse_openhands(obj, path, index)
        except TrajectoryError as err:
            stats.skip(err)
            log.warning("%s", err)
            continue
        stats.sessions += 1
        yield session


def trajectory_files(root: Path) -> list[Path]:
    """Every trajectory file under `root` (sorted, so loads are deterministic)."""
    root = Path(root)
    if not root.is_dir():
        raise SlackTierError(ErrorKind.MISSING, f"no trajectory directory {root}",
                             fix="download a published set (SWE-agent .traj, mini-swe-agent .traj.json, OpenHands "
                                 "output.jsonl, Nebius .nebius.json) into a local directory and pass it")
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            try:
                format_of(p)
            except TrajectoryError:
                continue
            out.append(p)
    return out


def load_trajectories(root: Path | None = None, stats: LoadStats | None = None) -> list[Session]:
    """Every session under `root` (None: the vendored sample); skipped records are counted in `stats` and logged."""
    stats = stats if stats is not None else LoadStats()
    files = trajectory_files(SAMPLE_DIR if root is None else Path(root))
    sessions = [s for p in files for s in iter_file(p, stats)]
    if stats.skipped:
        log.warning("trajectories: %d of %d records skipped", len(stats.skipped), stats.records)
    if not sessions:
        raise SlackTierError(ErrorKind.MISSING, f"no trajectory parsed under {root or SAMPLE_DIR}",
                             fix="check the directory holds .traj, .traj.json, .nebius.json or output.jsonl files")
    return sessions
