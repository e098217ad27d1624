"""The pinned SGLang release's own contract, read from its wheel: the tests' source of truth.

What it is: `fetch_release()` downloads `sglang==<pin>` with `pip download --no-deps` into
~/.cache/megatron_darl/test_assets/ (`MEGATRON_DARL_CACHE` moves it; once, the wheel is reused
afterwards), unpacks the few files the protocol lives in, and returns a `Release` that exposes
them. The wheel is asked for by its published tag (`WHEEL_TAG`: CPython 3.11, manylinux_2_34
x86_64), not for the running interpreter, because it is only read: the tests run the same on
Python 3.10, older glibc or another CPU, where pip would find no wheel of that release for the
machine itself.
- `api` — `sglang/api/v1/api_types.py`, the release's generated JSON contract of the HTTP API
  (`GenerateRequest.from_json_value` is the 400-gate `/generate` runs first; `GenerateResponse`
  decodes answers), imported as a module (it needs only msgspec);
- `SamplingParams` — `srt/sampling/sampling_params.py`'s strict msgspec struct, imported without
  SGLang's package `__init__` (which pulls in its whole dependency tree); the tokenizer manager
  builds it as `SamplingParams(**sampling_params)`, then `normalize(None)` and `verify(vocab)`;
- `weight_versions` — `srt/utils/weight_versions.py` (per-token version spans, computed and
  written into meta_info by the release's own functions);
- `io_fields(name)` — the fields of a request class of `srt/managers/io_struct.py`
  (`GenerateReqInput`, `UpdateWeightFromDiskReqInput`, ...), parsed with `ast` (importing that
  module needs zmq, pydantic schemas, and most of SGLang), with `check_io_body` validating a
  JSON body against their annotations;
- `routes` — route -> HTTP methods, from the decorators of `srt/entrypoints/http_server.py`;
- `session_rules` — the weight-update session, from the scheduler's
  `srt/managers/scheduler_components/weight_updater.py` parsed with `ast`: which requests are
  refused without a session (a `self._session is None` guard) or with one (`is not None`), with
  the message of each refusal, and which request opens and which closes it;
- `flush_rules` — when a weight update's `flush_cache` is refused, from the same file and the
  scheduler's `srt/managers/scheduler.py` (`flush_cache`, `pause_generation`) parsed with `ast`:
  the refusal that fails the update, whether a paused engine's waiting queue is ignored, and the
  pause modes that leave the running batch (and its KV) in place.
The download needs the package index: `require_release()` skips the calling test, saying so,
when the index cannot be reached (an offline machine), unless DARL_REQUIRE_NETWORK=1 (CI), where
it fails; any other failure (no such release, a broken wheel) is an error, never a skip.
What it is not: SGLang itself (no server, no scheduler), or a test.
"""

from __future__ import annotations

import ast
import fcntl
import glob
import importlib
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass, field
from typing import Any

from megatron_darl.data.tokenizers import default_cache_dir
from megatron_darl.rollout.sglang_requests import SGLANG_VERSION
from tests.helpers.network import needs_network

# the tag sglang 0.5.23 publishes its only wheel under (checked with `pip download`); pure-Python
# files are read from it, so any interpreter can use it
WHEEL_TAG = {"python_version": "3.11", "implementation": "cp", "abi": "cp311",
             "platform": "manylinux_2_34_x86_64"}

CACHE = str(default_cache_dir() / "test_assets")  # the project's one cache folder
FILES = (
    "sglang/api/v1/api_types.py",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/srt/sampling/watermarking/__init__.py",
    "sglang/srt/sampling/watermarking/config.py",
    "sglang/srt/sampling/watermarking/core.py",
    "sglang/srt/sampling/watermarking/detector.py",
    "sglang/srt/utils/weight_versions.py",
    "sglang/srt/utils/msgspec_utils.py",
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/managers/tokenizer_manager.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/srt/managers/scheduler_components/weight_updater.py",
    "sglang/srt/managers/scheduler.py",
)
WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"


class ReleaseUnavailable(RuntimeError):
    """The pinned wheel could not be downloaded or read."""


def fetch_release(version: str = SGLANG_VERSION, cache: str = CACHE) -> "Release":
    """Download (once) and unpack the release; raises ReleaseUnavailable naming the command."""
    folder = os.path.join(cache, f"sglang-{version}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:  # parallel test sessions share the cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheels = glob.glob(os.path.join(folder, f"sglang-{version}-*.whl"))
        if not wheels:
            tag = [arg for key, value in WHEEL_TAG.items() for arg in (f"--{key.replace('_', '-')}", value)]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={version}",
                   "--only-binary=:all:", *tag, "-d", folder]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            wheels = glob.glob(os.path.join(folder, f"sglang-{version}-*.whl"))
            if run.returncode != 0 or not wheels:
                raise ReleaseUnavailable(f"`{' '.join(cmd)}` failed (exit {run.returncode}): "
                                         f"{(run.stderr or run.stdout)[-2000:]}")
        root = os.path.join(folder, "src")
        if not all(os.path.isfile(os.path.join(root, f)) for f in FILES):
            try:
                with zipfile.ZipFile(wheels[0]) as zf:
                    for name in FILES:
                        zf.extract(name, root)
            except (zipfile.BadZipFile, KeyError) as exc:
                os.unlink(wheels[0])  # a broken download: fetch anew next time
                raise ReleaseUnavailable(f"{wheels[0]}: cannot read {exc}") from exc
    return Release(version, root)


def require_release(version: str = SGLANG_VERSION) -> "Release":
    """`fetch_release` for a test: skips it, naming the reason, where the package index cannot be
    reached and no wheel is cached (unless DARL_REQUIRE_NETWORK=1)."""
    folder = os.path.join(CACHE, f"sglang-{version}")
    if not glob.glob(os.path.join(folder, f"sglang-{version}-*.whl")):
        needs_network(f"downloads the sglang=={version} wheel to read its protocol")
    return fetch_release(version)


def _load(root: str, module: str) -> types.ModuleType:
    """Import `module` from the unpacked release without running SGLang's package `__init__`s:
    every parent package is an empty stand-in whose path is the release's folder."""
    parts = module.split(".")
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    try:
        for i in range(1, len(parts)):
            name = ".".join(parts[:i])
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(root, *parts[:i])]
            sys.modules[name] = pkg
        return importlib.import_module(module)
    finally:  # leave no `sglang` behind for code that probes whether SGLang is installed
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@dataclass
class IOField:
    name: str
    annotation: ast.expr | None
    required: bool


@dataclass
class Release:
    version: str
    root: str
    _modules: dict[str, types.ModuleType] = field(default_factory=dict)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def module(self, name: str) -> types.ModuleType:
        if name not in self._modules:
            self._modules[name] = _load(self.root, name)
        return self._modules[name]

    @property
    def api(self) -> types.ModuleType:
        return self.module("sglang.api.v1.api_types")

    @property
    def SamplingParams(self) -> type:  # the release's class name
        return self.module("sglang.srt.sampling.sampling_params").SamplingParams

    @property
    def weight_versions(self) -> types.ModuleType:
        return self.module("sglang.srt.utils.weight_versions")

    def source(self, rel: str) -> str:
        with open(self.path(rel), encoding="utf-8") as fh:
            return fh.read()

    # ---- io_struct.py, read as source ---------------------------------------------------
    def io_fields(self, cls_name: str) -> dict[str, IOField]:
        """Fields of a request class (with those of its bases in the same file)."""
        tree = ast.parse(self.source("sglang/srt/managers/io_struct.py"))
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        if cls_name not in classes:
            raise KeyError(f"io_struct.py of sglang {self.version} has no class {cls_name}")
        out: dict[str, IOField] = {}
        for base in classes[cls_name].bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(self.io_fields(base.id))
        for stmt in classes[cls_name].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = IOField(stmt.target.id, stmt.annotation, stmt.value is None)
        return out

    def check_io_body(self, cls_name: str, body: dict[str, Any]) -> None:
        """Raise AssertionError if `body` has a key the class lacks (SGLang would ignore it
        silently), lacks a required field, or has a value its annotation does not admit."""
        fields = self.io_fields(cls_name)
        unknown = sorted(set(body) - set(fields))
        assert not unknown, f"{cls_name} (sglang {self.version}) has no field(s) {unknown}"
        missing = sorted(n for n, f in fields.items() if f.required and n not in body)
        assert not missing, f"{cls_name} (sglang {self.version}) requires {missing}"
        for key, value in body.items():
            ann = fields[key].annotation
            assert ann is None or _admits(ann, value), (
                f"{cls_name}.{key}: {value!r} does not fit `{ast.unparse(ann)}` (sglang {self.version})")

    @property
    def session_rules(self) -> SessionRules:
        return parse_session_rules(self.source(WEIGHT_UPDATER))

    @property
    def flush_rules(self) -> FlushRules:
        return parse_flush_rules(self.source(WEIGHT_UPDATER), self.source(SCHEDULER))

    # ---- http_server.py, read as source --------------------------------------------------
    @property
    def routes(self) -> dict[str, set[str]]:
        """Route -> HTTP methods of every `@app.get/post/put/api_route` in http_server.py."""
        tree = ast.parse(self.source("sglang/srt/entrypoints/http_server.py"))
        routes: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                    continue
                if not (dec.args and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                    continue  # routes named by environment variables
                kind = dec.func.attr
                if kind == "api_route":
                    kw = {k.arg: k.value for k in dec.keywords}
                    methods = {e.value for e in kw["methods"].elts} if "methods" in kw else {"GET"}
                elif kind in ("get", "post", "put", "delete", "head"):
                    methods = {kind.upper()}
                else:
                    continue
                routes.setdefault(dec.args[0].value, set()).update(methods)
        return routes


@dataclass
class SessionRules:
    """The release's weight-update session, per request (the scheduler method's name, which is
    also its route's name): refused outside a session / inside one, with the message."""

    refused_without: dict[str, str]  # e.g. update_weights_from_distributed, end_weight_update
    refused_while_open: dict[str, str]  # begin_weight_update
    opens: set[str]
    closes: set[str]


def _guard(node: ast.If) -> str | None:
    """"without" for `if self._session is None:`, "open" for `is not None`, else None."""
    t = node.test
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.left, ast.Attribute)
            and t.left.attr == "_session" and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value is None):
        return None
    return {ast.Is: "without", ast.IsNot: "open"}.get(type(t.ops[0]))


def _refusal(node: ast.If) -> str:
    """The `message=` of the `return XxxReqOutput(success=False, message=...)` a guard returns."""
    for stmt in node.body:
        if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call):
            kw = {k.arg: k.value for k in stmt.value.keywords}
            if isinstance(kw.get("success"), ast.Constant) and kw["success"].value is False:
                if isinstance(kw.get("message"), ast.Constant):
                    return kw["message"].value
    raise AssertionError(f"weight_updater.py line {node.lineno}: a session guard without a literal refusal")


def _session_assignments(fn: ast.AST) -> set[str]:
    """"opens" / "closes" for `self._session = <a session>` / `self._session = None` in `fn`."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "_session" for t in n.targets):
            if isinstance(n.value, ast.Constant) and n.value.value is None:
                out.add("closes")
            elif isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name):
                out.add("opens")  # `_WeightUpdateSession(...)`; `msgspec.structs.replace` only updates it
    return out


def parse_session_rules(source: str) -> SessionRules:
    rules = SessionRules({}, {}, set(), set())
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            kind = _guard(n) if isinstance(n, ast.If) else None
            if kind is not None:
                (rules.refused_without if kind == "without" else rules.refused_while_open)[fn.name] = _refusal(n)
        for what in _session_assignments(fn):
            (rules.opens if what == "opens" else rules.closes).add(fn.name)
    return rules


@dataclass
class FlushRules:
    """A weight update's cache flush in the release: `refusal` fails the update when requests
    hold KV; paused, the waiting queue is ignored (`ignores_waiting_when_paused`); the pause
    modes in `keep_running` leave the running batch as it is, the others empty it."""

    refusal: str
    ignores_waiting_when_paused: bool
    keep_running: set[str]
    others_retract: bool


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{len(found)} functions named {name}"
    return found[0]


def parse_flush_rules(updater: str, scheduler: str) -> FlushRules:
    fn = _function(ast.parse(updater), "flush_cache_after_weight_update")
    refusals = [r.value.elts[1].value for r in ast.walk(fn) if isinstance(r, ast.Return)
                and isinstance(r.value, ast.Tuple) and isinstance(r.value.elts[0], ast.Constant)
                and r.value.elts[0].value is False and isinstance(r.value.elts[1], ast.Constant)]
    assert len(refusals) == 1, "flush_cache_after_weight_update: no literal refusal"
    tree = ast.parse(scheduler)
    flush = _function(tree, "flush_cache")
    ignores = any(isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "is_fully_idle" and any(
        k.arg == "ignore_waiting" and getattr(k.value, "attr", "") == "_engine_paused" for k in c.keywords)
        for c in ast.walk(flush))
    pause, keep = _function(tree, "pause_generation"), set()
    for n in ast.walk(pause):  # `if recv_req.mode == "<m>": ... return` before the running batch is touched
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and getattr(n.test.left, "attr", "") == "mode" \
                and isinstance(n.body[-1], ast.Return) and isinstance(n.test.comparators[0], ast.Constant):
            keep.add(n.test.comparators[0].value)
    emptied = any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.running_batch.reqs"
                  and ast.unparse(n.value) == "[]" for n in ast.walk(pause))
    return FlushRules(refusals[0], ignores, keep, emptied)


_SCALARS = {"str": str, "int": int, "float": (int, float), "bool": bool, "bytes": bytes}


def _admits(ann: ast.expr, value: Any) -> bool:
    """Whether a JSON value fits a typing annotation of io_struct.py (the subset those classes
    use for the fields a client sends; anything else fails loudly)."""
    if isinstance(ann, ast.Constant) and ann.value is None:
        return value is None
    if isinstance(ann, ast.Name):
        if ann.id == "Any":
            return True
        if ann.id in _SCALARS:
            # JSON has no int/bool distinction in Python's eyes: true is not a number here
            return isinstance(value, _SCALARS[ann.id]) and (ann.id == "bool" or not isinstance(value, bool))
        raise AssertionError(f"cannot check a value against the release's type `{ann.id}`")
    if isinstance(ann, ast.Subscript):
        head = ann.value.id if isinstance(ann.value, ast.Name) else ast.unparse(ann.value)
        args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head == "Optional":
            return value is None or _admits(args[0], value)
        if head == "Union":
            return any(_admits(a, value) for a in args)
        if head == "List":
            return isinstance(value, list) and all(_admits(args[0], v) for v in value)
        if head == "Dict":
            return isinstance(value, dict) and all(_admits(args[0], k) and _admits(args[1], v)
                                                   for k, v in value.items())
        if head == "Literal":
            return value in [a.value for a in args]
        if head == "Annotated":
            return _admits(args[0], value)
    raise AssertionError(f"cannot check a value against the release's type `{ast.unparse(ann)}`")
