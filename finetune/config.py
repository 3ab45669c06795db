"""Loading a config: YAML files and dotted overrides into the typed schema, every key and value checked.

A run is described by :class:`~finetune.schema.Config`, a tree of dataclasses
(:mod:`finetune.schema`, where each key is documented). YAML files are loaded
into it with :func:`load_config`; every key is checked against the schema, so
an unknown key or a value of the wrong type stops the run at start-up with a
message naming the key and the file. Command-line overrides use dotted paths
(``optim.learning_rate=3e-5``) and go through the same checks.

The schema's names are importable from here too (``from finetune.config import Config``).

Hand-written rather than pydantic, OmegaConf or jsonargparse: those report a
bad value in several lines and their own words; here each error is one line
that names the key and the file, with a "did you mean" across sections.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from finetune.coerce import _describe, coerce_value
from finetune.errors import ConfigError
from finetune.key_hints import key_hint, refuse_options, unknown_key_hint
from finetune.overrides import let_the_command_line_choose
from finetune.problem_checks import PROBLEM_METRICS, check_for_problem_type  # noqa: F401  (importable from here)
from finetune.schema import (  # noqa: F401  (the schema's names, importable from here as before)
    DEFAULT_METRICS, DEFAULT_THRESHOLD, PAD_TO_MULTIPLE_OF, PER_LABEL, SECTIONS, Config, DataConfig, EvalConfig,
    LoggingConfig, ModelConfig, OptimConfig, OutputConfig, TrainingConfig,
)

__all__ = ["Config", "ModelConfig", "DataConfig", "TrainingConfig", "OptimConfig", "EvalConfig", "LoggingConfig",
           "OutputConfig", "DEFAULT_CONFIG", "SHIPPED_CONFIGS", "is_shipped", "load_config", "config_from_dict",
           "parse_override", "read_yaml", "config_yaml", "save_config", "origin_of",
           "unknown_key_hint", "refuse_options", "PER_LABEL", "PAD_TO_MULTIPLE_OF"]


def _default_config() -> Path:
    """``configs/default.yaml`` of a source checkout, or the copy a wheel installs inside the package."""
    here = Path(__file__).resolve().parent
    candidates = (here.parent / "configs" / "default.yaml", here / "configs" / "default.yaml")
    return next((c for c in candidates if c.is_file()), candidates[0])


DEFAULT_CONFIG = _default_config()
SHIPPED_CONFIGS = DEFAULT_CONFIG.parent  # the package's configs/: its runs' configs, sweeps/ and accelerate/


def is_shipped(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` (``None``: the default) is one of the run configs the package ships."""
    return path is None or Path(path).resolve().parent == SHIPPED_CONFIGS


# --------------------------------------------------------------------------- loading


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data:
            raise ConfigError(f"{prefix + '.' if prefix else ''}{f.name}: required section is missing")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{path}: unknown key{key_hint(str(key), names, prefix)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, path)
        else:
            kwargs[key] = coerce_value(value, tp, path)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted == 'a.b.c'``, checking the path exists; ``source`` names the
    file ``tree`` was read from, whose section may not be a mapping."""
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        sections = [f.name for f in dataclasses.fields(Config)]
        raise ConfigError(f"override {dotted!r}: expected section.key, one of sections {', '.join(sections)}"
                          f"{unknown_key_hint(dotted)}")
    section, key = parts
    section_fields = {f.name: f for f in dataclasses.fields(Config)}
    if section not in section_fields:
        close = difflib.get_close_matches(section, list(section_fields), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"override {dotted!r}: unknown section {section!r}{hint}")
    node = tree.setdefault(section, {})
    if node is None:
        node = tree[section] = {}
    if not isinstance(node, dict):
        raise ConfigError(f"{source}: {section}: expected a mapping of keys, got {_describe(node)}")
    node[key] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value`` and parse the value as a YAML scalar.

    Raises:
        ConfigError: if there is no ``=`` or the key is empty.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value (missing '=')")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if value == "" and raw.strip() not in ('""', "''"):
        value = raw.strip()  # `|` and `>` alone are YAML block markers that read as empty: the user meant the character
    if isinstance(value, dict) and any(isinstance(k, str) and ":" in k and v is None for k, v in value.items()):
        # `{0:8,4:2}` is valid YAML for the keys '0:8' and '4:2' without values: a shell-typed mapping
        # is far likelier to have meant `{0: 8, 4: 2}`, and the schema's complaint would not say why
        spaced = re.sub(r"([:,])(?=\S)", r"\1 ", raw.strip())
        raise ConfigError(f"override {text!r}: YAML needs a space after each ':' of a mapping; "
                          f"write {key}=\"{spaced}\"")
    return key, _text_where_text_is_meant(key, value, raw.strip())


# how YAML spells null: typed so, a key that may be null is set to null, not to the word
_NULL_SPELLINGS = ("", "~", "null", "Null", "NULL")


def _text_where_text_is_meant(dotted: str, value: Any, raw: str) -> Any:
    """An override's value as the text typed, where the key takes a string and YAML read the text as another
    scalar: a column named `2024`, `no` or `#1 String` (YAML's int, bool, and a comment, so null), a
    separator `#`. A quoted value, and null spelled as such, stay YAML's; so does every other key's value."""
    if isinstance(value, (str, list, dict)) or raw[:1] in ("'", '"') or (value is None and raw in _NULL_SPELLINGS):
        return value
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        return value  # _set_dotted names the unknown section
    tp = typing.get_type_hints(SECTIONS[section]).get(key)
    takes_text = tp is str or (typing.get_origin(tp) is typing.Union and str in typing.get_args(tp))
    return raw if takes_text else value


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key written twice in one mapping.

    YAML requires a mapping's keys to be unique, and PyYAML keeps the last of two without a word: a
    ``training:`` section added at the end of a file would silently replace every key of the one above.
    PyYAML has no switch for the check, hence this subclass. Merge keys (``<<: *base``) still override.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            _refuse_repeated_keys(node)
        return super().construct_mapping(node, deep=deep)


def _refuse_repeated_keys(node: yaml.MappingNode) -> None:
    first_line: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        earlier = first_line.get((key.tag, key.value))
        if earlier is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key.value!r} is written twice in one mapping ({_lines(earlier, line)}); "
                f"YAML would keep only the last: merge them into one", key.start_mark)
        first_line[(key.tag, key.value)] = line


def _lines(first: int, second: int) -> str:
    return f"line {first}" if first == second else f"lines {first} and {second}"


def read_yaml(path: str | os.PathLike, what: str = "config file", hint: Optional[str] = None) -> dict[str, Any]:
    """Read a YAML file (``what``: a config file, a sweep file) with the safe loader; ``hint`` goes with a missing
    file's error.

    Raises:
        ConfigError: if the file is missing, not a readable file, not YAML, or not a mapping.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} not found: {p}", hint=hint)
    if not p.is_file():
        raise ConfigError(f"{what} {p}: not a file (a YAML file is expected)")
    try:
        with open(p, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_UniqueKeyLoader)
    except OSError as exc:  # unreadable: permissions, a broken mount
        raise ConfigError(f"{what} {p}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p}:{where} not valid YAML: {problem}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte offset {exc.start})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level, got {_describe(data)}")
    return data


# What a file mapping (``train_file: {path: ..., format: ...}``) may say about its file.
FILE_LAYOUT_KEYS = ("format", "has_header", "column_names", "encoding", "sheet", "quoting")
# the data section's files, which one layout reads
_FILE_KEYS = ("train_file", "validation_file", "test_file")


def _with_file_layouts(data: dict[str, Any]) -> dict[str, Any]:
    """``data.train_file`` / ``data.validation_file`` / ``data.test_file`` given as mappings, flattened into the data
    section.

    A mapping holds the file's ``path`` and the settings that describe that
    file alone; an override that names another file replaces the mapping, and
    its settings go with it. Both files share one layout, so where both are
    mappings they must agree.

    Raises:
        ConfigError: for a mapping without ``path``, an unknown key in it, a
            setting given both in it and in the data section, or two files that disagree.
    """
    section = data.get("data")
    if not isinstance(section, dict) or not any(isinstance(section.get(k), dict) for k in _FILE_KEYS):
        return data
    section = dict(section)
    layout: dict[str, Any] = {}
    first: dict[str, str] = {}  # the file that gave each layout key first
    for file_key in _FILE_KEYS:
        spec = section.get(file_key)
        if not isinstance(spec, dict):
            continue
        unknown = [k for k in spec if k not in ("path", *FILE_LAYOUT_KEYS)]
        if unknown:
            raise ConfigError(f"data.{file_key}.{unknown[0]}: unknown key (a file mapping takes path, "
                              f"{', '.join(FILE_LAYOUT_KEYS)})")
        if "path" not in spec:
            raise ConfigError(f"data.{file_key}.path: required in a file mapping")
        section[file_key] = spec["path"]
        for key in FILE_LAYOUT_KEYS:
            if key not in spec:
                continue
            if key in data["data"]:
                raise ConfigError(f"data.{key}: given both in data.{file_key} and in data; keep one")
            if key in layout and layout[key] != spec[key]:
                raise ConfigError(f"data.{file_key}.{key}: {spec[key]!r} differs from data.{first[key]}'s "
                                  f"{layout[key]!r}; the files are read with one layout")
            layout[key] = spec[key]
            first.setdefault(key, file_key)
    section.update(layout)
    return {**data, "data": section}


def config_from_dict(data: dict[str, Any], source: str | None = None, metrics_chosen: bool = True) -> Config:
    """Build and validate a :class:`Config` from nested dicts.

    Args:
        data: ``{"model": {...}, "training": {...}, ...}``; missing keys take defaults.
        source: File name to prefix error messages with.
        metrics_chosen: Whether ``evaluation.metrics`` is the user's list, not a shipped config's (see below).

    Raises:
        ConfigError: naming the key (and ``source``) on any unknown key, wrong type or bad value.
    """
    try:
        return _check_across_sections(_build(Config, _with_file_layouts(data), ""), metrics_chosen)
    except ConfigError as exc:
        if source:
            raise ConfigError(f"{source}: {exc.message}", exc.hint) from None
        raise


def _check_across_sections(cfg: Config, metrics_chosen: bool) -> Config:
    """Rules that tie keys of two sections together."""
    check_for_problem_type(cfg, metrics_chosen)
    if cfg.evaluation.load_best_model_at_end and not cfg.output.save_checkpoints:
        raise ConfigError("evaluation.load_best_model_at_end: needs output.save_checkpoints: true "
                          "(the best model is kept as its checkpoint)")
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply dotted overrides, and validate everything.

    Args:
        path: YAML file; ``None`` uses ``configs/default.yaml`` of this repository.
        overrides: ``["optim.learning_rate=3e-5", "training.seed=1"]``.

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: one line naming the file and key at fault.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    data = read_yaml(path)
    given = set()
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value, str(path))
        given.add(key)
    let_the_command_line_choose(data, given, path)
    try:
        return config_from_dict(data, metrics_chosen="evaluation.metrics" in given or not is_shipped(path))
    except ConfigError as exc:
        raise ConfigError(f"{origin_of(exc.message, path, overrides or [])}: {exc.message}", exc.hint) from None


_KEY_AT_START = re.compile(r"^([a-z_]+)\.([a-z_0-9]+)\b")


def origin_of(message: str, path: str | os.PathLike | None, overrides: list[str]) -> str:
    """Where the key that ``message`` starts with came from, for the front of an error line.

    ``command line`` when an override (or ``--data``, ``--text``, ...) set it;
    else the YAML file, with the key's line when the file has it; the file
    alone for a message about no particular key.

    Args:
        message: An error message; ``section.key: ...`` names the key at fault.
        path: The YAML file (``None``: the default config).
        overrides: The ``section.key=value`` overrides of the command line.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    match = _KEY_AT_START.match(message)
    if match is None:
        return str(path)
    section, key = match.groups()
    if f"{section}.{key}" in {text.split("=", 1)[0].strip() for text in overrides}:
        return "command line"
    line = _line_of(path, section, key)
    return f"{path}:{line}" if line else str(path)


def _line_of(path: Path, section: str, key: str) -> int | None:
    """The line of ``section: key:`` in a YAML file, or ``None`` where the file does not write it."""
    try:
        with open(path, encoding="utf-8") as fh:
            root = yaml.compose(fh)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    section_node = _value_of(root, section)
    key_node = _key_node(section_node, key)
    return key_node.start_mark.line + 1 if key_node is not None else None


def _key_node(mapping, name: str):
    """The key node ``name`` of a YAML mapping node (``None`` when absent, or not a mapping)."""
    if not isinstance(mapping, yaml.MappingNode):
        return None
    return next((k for k, _ in mapping.value if isinstance(k, yaml.ScalarNode) and k.value == name), None)


def _value_of(mapping, name: str):
    key = _key_node(mapping, name)
    return next(v for k, v in mapping.value if k is key) if key is not None else None


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML text (what the run really used)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (what the run really used)."""
    Path(path).write_text(config_yaml(cfg), encoding="utf-8")
