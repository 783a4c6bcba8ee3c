"""A run's config from its YAML files: `extends:` (relative to the file, depth-first), `--set section.key=value`
overrides (each value read as YAML), validated as zerolm.config.tree's schema says; the first problem as one line
that names the file, the key and, where a `--set` made it, that flag.

`configs/defaults.yaml` holds every key with its default; a model-size file extends it and changes what differs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from zerolm.config.section import ConfigError, _KeyError, set_dotted
from zerolm.config.tree import Config

# configs/defaults.yaml, shipped in the package (src/zerolm/config/defaults.yaml is a link to it, which a wheel holds as the
# file): found wherever zerolm is installed and whatever the working directory.
DEFAULTS = Path(__file__).with_name("defaults.yaml")


# Keys that were renamed: an old config gets told the new name instead of "unknown key".
RENAMED = {"train.eval_batches": "train.eval_sequences (validation sequences per evaluation, independent of "
                                 "dp and micro-batch)"}


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """Read a YAML file, following `extends:` (relative to the file) depth-first."""
    if path in chain:
        raise ConfigError(f"{path}: extends itself through {' -> '.join(map(str, chain))}")
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    return _deep_merge(_read_yaml(path.parent / parent, chain + (path,)), data)


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value`, with the value parsed as YAML (so 3 is an int and true a bool)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path, overrides: Sequence[str] = (), device_count: int | None = None,
                say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Config:
    """Load and validate a config. With `device_count`, `mesh.dp: auto` is resolved and checked. What the
    config resolves differently from what it says (a warmup clamped to the schedule) is said, one line each."""
    path = Path(path)
    data = _read_yaml(path)
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value)
        overridden.add(key)
    notes: list[str] = []
    try:
        cfg = Config.model_validate(data, context={"device_count": device_count, "notes": notes})
    except ValidationError as e:
        raise ConfigError(_describe(path, e, overridden)) from None
    for line in notes:
        say(line)
    return cfg


def _describe(path: Path, error: ValidationError, overridden: set[str]) -> str:
    """One line for the first problem, naming the file and the dotted key; a count of the rest. What only
    follows from another problem is none of its own: a key that may be None (data.mixture) reports that it is
    not None, and a list whose entry failed that it is too short. An unknown key comes first (`wieght` is why
    `weight` is missing)."""
    locs = [e["loc"] for e in error.errors()]
    errors = [e for e in error.errors() if e["type"] != "none_required"
              and not any(len(other) > len(e["loc"]) and other[:len(e["loc"])] == e["loc"] for other in locs)]
    errors = errors or error.errors()
    # A misspelled key is the cause of the missing one it was meant to be: name it first.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    cause = first.get("ctx", {}).get("error")
    related: tuple[str, ...] = ()
    if isinstance(cause, _KeyError):
        key, message, related = cause.key, str(cause).split(": ", 1)[1], cause.related
    else:
        key = ".".join(str(p) for p in first["loc"]) or "(top level)"
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"renamed to {RENAMED[key]}" if key in RENAMED else "unknown key"
        elif first["type"] == "missing":
            message = "missing key (every key needs a value; see configs/defaults.yaml)"
        elif "input" in first and not isinstance(first["input"], (dict, list)):
            message = f"{message} (got {first['input']!r})"
    hits = sorted(o for o in overridden for k in (key, *related) if o == k or o.startswith(k + ".") or k.startswith(o + "."))
    where = f"{path} (--set {hits[0]})" if hits else str(path)
    more = len(errors) - 1
    return f"{where}: {key}: {message}" + (f" [and {more} more problem(s)]" if more else "")
