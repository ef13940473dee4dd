"""SWE-agent-style coding sessions built from real code and real tool output.

A session follows mini-swe-agent's SWE-bench template (`swebench_backticks.yaml`
shipped in the `mini-swe-agent` package): its system prompt, its instance
prompt around a task, then turns of an assistant action (a THOUGHT line and one
```mswea_bash_command``` block) and a user observation rendered with the
template's own observation template from the command's real output.

Every command is run with bash on a copy of a real source tree found among the
installed packages (requests/, torch/_dynamo/, ...), committed to a fresh git
repository so `git diff` after a real `sed -i` edit is real too. The action
plan (which files, functions, identifiers, how many exploration turns) is drawn
from a seeded generator; the command output is never written by us. What *is*
written by us: the short THOUGHT lines and the frame of the task text around the
target function's real docstring (mini-swe-agent sessions carry a model's prose
there; we have no model, so both are one fixed sentence per action kind).

Determinism: sorted listings, LC_ALL=C, TZ=UTC, fixed git identity and dates,
PYTHONHASHSEED=0, no command that prints a time, and the temporary directory's
path rewritten to /testbed (the template's working directory) in every output.
Generated sessions are cached as .npz token files keyed by (seed, source, index,
params, generator version, a fingerprint of the source tree).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.workloads.sessions import Session, TokenSession, Turn, render_session

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1
TEMPLATE_FILE = "benchmarks/swebench_backticks.yaml"
SANDBOX_NAME = "/testbed"

# Source trees under site-packages (pure Python, a few hundred KB to a few MB each).
AGENT_SOURCES: tuple[str, ...] = (
    "requests", "urllib3", "idna", "charset_normalizer", "jinja2", "yaml", "packaging", "click",
    "tqdm", "hypothesis", "numba/core", "numpy/lib", "torch/_dynamo", "transformers/models/llama",
    "transformers/models/deepseek_v4", "tokenizers", "safetensors", "sympy/core", "rich", "attr",
    "filelock", "fsspec", "huggingface_hub", "redis", "pluggy", "_pytest", "typer", "pydantic",
)
COPY_SUFFIXES = (".py", ".pyi", ".md", ".txt", ".cfg", ".toml", ".typed", ".rst")
MAX_COPY_FILE_BYTES = 400_000


@dataclass(frozen=True)
class AgentParams:
    """How long and how varied the generated sessions are."""

    min_explore_turns: int = 2    # exploration actions between reading the target and editing it
    max_explore_turns: int = 10
    max_view_lines: int = 80      # longest `sed -n` window
    command_timeout_s: float = 60.0  # the template's own timeout
    template: str = TEMPLATE_FILE

    def __post_init__(self) -> None:
        if not 0 <= self.min_explore_turns <= self.max_explore_turns:
            raise SlackTierError(ErrorKind.BAD_INPUT, "min_explore_turns must be <= max_explore_turns",
                                 fix="pass 0 <= min_explore_turns <= max_explore_turns")


@dataclass(frozen=True)
class AgentTemplate:
    """The mini-swe-agent prompts used to render a session."""

    system_template: str
    instance_template: str
    observation_template: str
    path: Path


def load_template(name: str = TEMPLATE_FILE) -> AgentTemplate:
    """Read a mini-swe-agent config (without importing the agent) and return its three templates."""
    import yaml

    spec = importlib.util.find_spec("minisweagent")
    if spec is None or not spec.submodule_search_locations:
        raise SlackTierError(ErrorKind.MISSING, "the mini-swe-agent package is not installed",
                             fix="pip install 'slacktier[workloads]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "config" / name
    if not path.exists():
        raise SlackTierError(ErrorKind.MISSING, f"mini-swe-agent has no config {name}",
                             fix="pass a template under minisweagent/config/, e.g. benchmarks/swebench_backticks.yaml")
    cfg = yaml.safe_load(path.read_text())
    return AgentTemplate(cfg["agent"]["system_template"], cfg["agent"]["instance_template"],
                         cfg["model"]["observation_template"], path)


def site_packages() -> Path:
    """The site-packages directory the agent sources are copied from."""
    return Path(sysconfig.get_paths()["purelib"])


def available_sources(names: Iterable[str] | None = None) -> list[str]:
    """The agent sources present on this machine (all of AGENT_SOURCES by default; named ones must exist)."""
    root = site_packages()
    if names is None:
        present = [n for n in AGENT_SOURCES if (root / n).is_dir()]
        missing = sorted(set(AGENT_SOURCES) - set(present))
        if missing:
            log.info("agent sources not installed here, skipped: %s", ", ".join(missing))
        return present
    names = list(names)
    for n in names:
        if not (root / n).is_dir():
            raise SlackTierError(ErrorKind.MISSING, f"no source tree {n} under {root}",
                                 fix=f"pick among {', '.join(available_sources())}")
    return names


def _source_files(source: str) -> list[Path]:
    root = site_packages() / source
    files = []
    for p in sorted(root.rglob("*")):
        if "__pycache__" in p.parts or not p.is_file() or p.suffix not in COPY_SUFFIXES:
            continue
        if p.stat().st_size > MAX_COPY_FILE_BYTES:
            continue
        files.append(p)
    return files


def source_fingerprint(source: str) -> str:
    """A digest of the copied files' names and sizes, so a changed install invalidates cached sessions."""
    root = site_packages() / source
    h = hashlib.sha256()
    for p in _source_files(source):
        h.update(f"{p.relative_to(root)}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def _fixed_env(home: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home), "LC_ALL": "C", "LANG": "C", "TZ": "UTC", "TERM": "dumb", "NO_COLOR": "1",
        "PAGER": "cat", "MANPAGER": "cat", "LESS": "-R", "PIP_PROGRESS_BAR": "off", "TQDM_DISABLE": "1",
        "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
        "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@example.invalid",
        "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@example.invalid",
        "GIT_AUTHOR_DATE": "2025-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00+0000",
        "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
    }


@dataclass(frozen=True)
class CommandResult:
    """A command as run in the sandbox: the output is stdout and stderr interleaved, paths rewritten."""

    command: str
    returncode: int
    output: str


class Sandbox:
    """A copy of one source tree in a temp dir, committed to a fresh git repository."""

    def __init__(self, source: str, workdir: Path, timeout_s: float) -> None:
        self.source = source
        self.root = workdir / "testbed"
        self.timeout_s = timeout_s
        self.env = _fixed_env(workdir)
        src_root = site_packages() / source
        for p in _source_files(source):
            dest = self.root / source / p.relative_to(src_root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dest)
        for cmd in ("git init -q -b main .", "git add -A", "git commit -q -m 'initial import'"):
            res = self.run(cmd)
            if res.returncode != 0:
                raise SlackTierError(ErrorKind.UNAVAILABLE, f"sandbox setup `{cmd}` failed: {res.output[:200]}",
                                     fix="install git (apt-get install -y git)")

    def run(self, command: str) -> CommandResult:
        """Run one bash command in the sandbox (the template's interpreter is `bash -c`)."""
        try:
            proc = subprocess.run(["bash", "-c", command], cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=self.timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"command timed out after {self.timeout_s} s: {command[:80]}",
                                 fix="the machine is overloaded; raise AgentParams.command_timeout_s") from exc
        text = proc.stdout.decode("utf-8", errors="replace")
        text = text.replace(str(self.root), SANDBOX_NAME)
        return CommandResult(command, proc.returncode, text)


# --- planning: what the agent looks at, from the real tree ---------------------------------------

@dataclass(frozen=True)
class _Func:
    path: str       # relative to the sandbox root
    qualname: str
    name: str
    start: int      # 1-based, def line (decorators excluded)
    end: int
    doc: str
    stores: tuple[str, ...]  # local names assigned in the body
    loads: tuple[str, ...]   # names and attributes read in the body


def _functions(rel: str, text: str) -> list[_Func]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out: list[_Func] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = {a.arg for a in ast.walk(child.args) if isinstance(a, ast.arg)}
                stores, loads = set(), set()
                for n in ast.walk(child):
                    if isinstance(n, ast.Name):
                        (stores if isinstance(n.ctx, ast.Store) else loads).add(n.id)
                    elif isinstance(n, ast.Attribute):
                        loads.add(n.attr)
                stores = {s for s in stores if s not in args and len(s) >= 3 and s.isidentifier()}
                loads = {s for s in loads if len(s) >= 4 and s.isidentifier()}
                doc = ast.get_docstring(child) or ""
                out.append(_Func(rel, f"{prefix}{child.name}", child.name, child.lineno,
                                 child.end_lineno or child.lineno, doc.split("\n\n")[0].strip(),
                                 tuple(sorted(stores)), tuple(sorted(loads))))
    visit(tree, "")
    return out


def _choice(rng: np.random.Generator, seq: Sequence):
    return seq[int(rng.integers(len(seq)))]


def _assistant(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def _render_observation(template: AgentTemplate, res: CommandResult) -> str:
    import jinja2

    output = {"returncode": res.returncode, "output": res.output, "exception_info": ""}
    return jinja2.Template(template.observation_template, undefined=jinja2.StrictUndefined).render(output=output)


def _ast_listing_command(path: str) -> str:
    return ("python - <<'EOF'\n"
            "import ast\n"
            f"tree = ast.parse(open({path!r}).read())\n"
            "for node in ast.walk(tree):\n"
            "    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):\n"
            "        print(node.lineno, type(node).__name__, node.name)\n"
            "EOF")


def generate_agent_session(source: str, seed: int, index: int, params: AgentParams = AgentParams(),
                           template: AgentTemplate | None = None) -> Session:
    """One agent session on `source`, every observation the real output of its command.

    Deterministic in seed and index."""
    import jinja2

    if template is None:
        template = load_template(params.template)
    rng = np.random.default_rng([seed, zlib.crc32(source.encode()), index])
    with tempfile.TemporaryDirectory(prefix="slacktier-agent-") as tmp:
        box = Sandbox(source, Path(tmp), params.command_timeout_s)
        py_files = sorted(str(p.relative_to(box.root)) for p in box.root.rglob("*.py") if ".git" not in p.parts)
        funcs_by_file: dict[str, list[_Func]] = {}
        for rel in py_files:
            funcs_by_file[rel] = _functions(rel, (box.root / rel).read_text(errors="replace"))
        candidates = [f for rel in py_files for f in funcs_by_file[rel]
                      if f.stores and 5 <= f.end - f.start <= 120]
        if not candidates:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"source {source} has no function to work on",
                                 fix="pick another agent source")
        target = _choice(rng, candidates)
        doc = target.doc or f"(no docstring; the function starts at line {target.start})"
        task = (f"`{target.qualname}` in `{target.path}` does not behave as its documentation says:\n\n"
                f"{doc}\n\nFind where it is implemented and fix it in a way that is consistent with the codebase.")
        system = jinja2.Template(template.system_template).render()
        instance = jinja2.Template(template.instance_template).render(task=task)
        turns: list[Turn] = [Turn("system", system), Turn("user", instance)]

        def act(thought: str, command: str) -> CommandResult:
            res = box.run(command)
            turns.append(Turn("assistant", _assistant(thought, command)))
            turns.append(Turn("user", _render_observation(template, res)))
            return res

        def view(f: _Func, thought: str) -> None:
            a = max(1, f.start - 2)
            b = min(f.end + 2, a + params.max_view_lines - 1)
            act(thought, f"sed -n '{a},{b}p' {f.path}")

        act("Let me look at the layout of the repository first.", "ls")
        act(f"Let me list the Python files under {source}.",
            f"find {source} -name '*.py' | sort | head -n 60")
        act(f"I need to find where `{target.name}` is defined.",
            f"grep -rn 'def {target.name}' --include='*.py' . | sort | head -n 20")
        view(target, f"Let me read `{target.qualname}` in {target.path}.")
        explore = int(rng.integers(params.min_explore_turns, params.max_explore_turns + 1))
        for _ in range(explore):
            kind = int(rng.integers(6))
            if kind == 0 and target.loads:
                name = _choice(rng, target.loads)
                act(f"`{target.name}` uses `{name}`; let me see where else it appears in this file.",
                    f"grep -n '{name}' {target.path} | head -n 30")
            elif kind == 1 and target.loads:
                name = _choice(rng, target.loads)
                act(f"Let me check how `{name}` is used across the code base.",
                    f"grep -rn '{name}' --include='*.py' . | sort | head -n 30")
            elif kind == 2:
                folder = os.path.dirname(target.path)
                small = [p for p in py_files if os.path.dirname(p) == folder
                         and len((box.root / p).read_bytes()) < 6000]
                if small:
                    path = _choice(rng, small)
                    act(f"Let me read {path}, a small module next to the target.", f"cat {path}")
                    continue
                act("Let me see what else is in this directory.", f"ls {folder}")
            elif kind == 3:
                others = [f for f in funcs_by_file[target.path] if f.qualname != target.qualname]
                if others:
                    f = _choice(rng, others)
                    view(f, f"`{f.qualname}` in the same file may interact with the target; let me read it.")
                    continue
                act(f"Let me list the definitions in {target.path}.", _ast_listing_command(target.path))
            elif kind == 4:
                act(f"Let me list the definitions in {target.path} with their line numbers.",
                    _ast_listing_command(target.path))
            else:
                act(f"Let me count the lines of the files in {os.path.dirname(target.path)}.",
                    f"wc -l {os.path.dirname(target.path)}/*.py | sort -n | tail -n 15")
        module = target.path[:-3].replace("/", ".")
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        act(f"Let me check that `{module}` imports and see what it exposes.",
            f"python -c \"import {module} as m; print(m.__name__); "
            f"print(sorted(n for n in vars(m) if not n.startswith('_'))[:40])\"")
        old = _choice(rng, target.stores)
        new = f"{old}_value"
        act(f"I'll rename the local `{old}` in `{target.name}` to make its role explicit.",
            f"sed -i '{target.start},{target.end}s/\\b{old}\\b/{new}/g' {target.path}")
        act("Let me review the change.", "git diff")
        act("Let me make sure the file still compiles.",
            f"python -m py_compile {target.path} && echo 'compiled OK'")
        view(target, "Let me read the edited function once more.")
        act("Now I'll write the patch file.", f"git diff -- {target.path} > patch.txt")
        act("Let me verify the patch.", "cat patch.txt")
        act("The patch only touches the target file; submitting.",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt")
    return Session(session_id=f"agent:{source}:{seed}:{index}", source=f"repo:{source}", kind="agent",
                   turns=tuple(turns))


# --- the on-disk cache of tokenized sessions -------------------------------------------------------

def cache_key(source: str, seed: int, index: int, params: AgentParams) -> str:
    """The cache file stem of one session: a digest of everything that decides its content."""
    key = json.dumps({"v": GENERATOR_VERSION, "source": source, "seed": seed, "index": index,
                      "params": dataclasses.asdict(params), "tree": source_fingerprint(source)}, sort_keys=True)
    return "agent-" + hashlib.sha256(key.encode()).hexdigest()[:20]


def save_session(path: Path, session: Session, tokens: TokenSession) -> None:
    """Write a session's turns and tokens to one .npz file (atomically)."""
    turns = json.dumps([[t.role, t.text] for t in session.turns], ensure_ascii=False).encode()
    meta = json.dumps({"session_id": session.session_id, "source": session.source, "kind": session.kind}).encode()
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens.tokens, reply_start=tokens.reply_start, reply_end=tokens.reply_end,
             turns=np.frombuffer(turns, dtype=np.uint8), meta=np.frombuffer(meta, dtype=np.uint8))
    os.replace(tmp, path)


def load_session(path: Path) -> tuple[Session, TokenSession]:
    """Read a session written by save_session."""
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        turns = tuple(Turn(r, t) for r, t in json.loads(z["turns"].tobytes().decode()))
        tok = TokenSession(meta["session_id"], meta["source"], meta["kind"], z["tokens"].astype(np.int32),
                           z["reply_start"].astype(np.int64), z["reply_end"].astype(np.int64))
    return Session(meta["session_id"], meta["source"], meta["kind"], turns), tok


def agent_sessions(sources: Sequence[str], sessions_per_source: int, seed: int, cache_dir: Path | None,
                   params: AgentParams = AgentParams(), progress: bool = False,
                   ) -> list[tuple[Session, TokenSession]]:
    """Agent sessions for every (source, index), generated once and then read from `cache_dir` (None: no cache)."""
    template = load_template(params.template)
    jobs = [(src, i) for src in sources for i in range(sessions_per_source)]
    if progress:
        from tqdm import tqdm
        jobs = tqdm(jobs, desc="agent sessions", unit="session")
    out = []
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
    for src, i in jobs:
        path = cache_dir / f"{cache_key(src, seed, i, params)}.npz" if cache_dir is not None else None
        if path is not None and path.exists():
            out.append(load_session(path))
            continue
        session = generate_agent_session(src, seed, i, params, template)
        tokens = render_session(session)
        if path is not None:
            save_session(path, session, tokens)
        out.append((session, tokens))
    return out
