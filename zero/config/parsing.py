"""The strict parser behind every section of a DeepSpeed config.

A section is a dataclass whose fields are DeepSpeed keys (declared with `option`/`section`).
`parse_section(cls, raw, source, path)` fills one from a JSON object and enforces the rules
DeepSpeed's pydantic sections follow, plus ours:

- a key that is not a field, an alias, a deprecated spelling or a `DEFAULT_ONLY` key is a
  `ConfigError` naming the key, its section and the closest valid key (DeepSpeed silently
  ignores unknown top-level keys; we do not);
- the value `"auto"` (the Hugging Face convention) means "use the default";
- ints accept integral floats (`5e8`), never bools; floats accept ints; bools must be JSON bools;
- `DEFAULT_ONLY = {key: default}` lists DeepSpeed keys zero does not implement: they are
  accepted only when they ask for DeepSpeed's default (e.g. `"auto_cast": false`), so a config
  that works in DeepSpeed still loads, but no option is ever parsed and then ignored;
- `DEFAULT_ONLY_HINTS = {key: what it is, what runs instead}` words that refusal for a
  DEFAULT_ONLY key users bring from real configs.
- `KEY_HINTS = {key: what to do instead}` words the error for a DeepSpeed key that is not
  built here but has a counterpart;
- a section may define `translate_deprecated(raw, source, path) -> raw` to map old spellings,
  and `check(source, path)` for checks that involve several keys.
"""

import dataclasses
import difflib
import json
import logging
import math
import typing

from zero.errors import ConfigError

AUTO = "auto"
logger = logging.getLogger("zero.config")

# DEFAULT_ONLY value for a monitoring/feature section that is accepted only while disabled.
DISABLED_SECTION = object()


def option(default, *, aliases=(), minimum=None, maximum=None, choices=None):
    """A DeepSpeed key of a section; `aliases` are other spellings DeepSpeed accepts."""
    metadata = {"aliases": tuple(aliases), "minimum": minimum, "maximum": maximum,
                "choices": choices}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls, *, optional=False, aliases=()):
    """A nested section; `optional` sections default to None (e.g. `optimizer`)."""
    metadata = {"aliases": tuple(aliases), "minimum": None, "maximum": None, "choices": None}
    if optional:
        return dataclasses.field(default=None, metadata=metadata)
    return dataclasses.field(default_factory=cls, metadata=metadata)


def fail(source, message):
    raise ConfigError(f"DeepSpeed config {source}: {message}")


def key_path(path, key):
    return f"{path}.{key}" if path else str(key)


def section_label(path):
    return "at the top level" if not path else f"in section '{path}'"


def show(value):
    """A value as the user wrote it in JSON (falls back to repr for non-JSON objects)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def accepted_keys(cls):
    """Every spelling accepted in section `cls`, mapped to its field (None: DEFAULT_ONLY)."""
    keys = {}
    for f in dataclasses.fields(cls):
        keys[f.name] = f
        for alias in f.metadata["aliases"]:
            keys[alias] = f
    for key in getattr(cls, "DEFAULT_ONLY", {}):
        keys[key] = None
    for key in getattr(cls, "DEPRECATED_KEYS", ()):
        keys[key] = None
    return keys


def unknown_key_message(key, path, cls, key_homes):
    candidates = [k for k in accepted_keys(cls) if k not in getattr(cls, "DEPRECATED_KEYS", ())]
    by_lower = {c.lower(): c for c in candidates}  # 'ENABLED' should still find 'enabled'
    words = sorted(str(key).lower().split("_"))  # 'comm_overlap' should find 'overlap_comm'
    close = [c for c in candidates if sorted(c.lower().split("_")) == words] or \
        [by_lower[c] for c in
         difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=0.6)]
    hint = getattr(cls, "KEY_HINTS", {}).get(key)
    message = f"unknown key '{key}' {section_label(path)}"
    if hint:  # says what the key is: a near spelling would mislead
        return f"{message}: {hint}"
    if close:
        message += f"; did you mean '{close[0]}'?"
    homes = [home for home in key_homes.get(key, ()) if home != path]
    if homes:
        where = " or ".join("the top level" if not h else f"section '{h}'" for h in homes)
        message += f" ('{key}' is a key of {where})"
    if not close and not homes:
        canonical = sorted(f.name for f in dataclasses.fields(cls))
        message += f"; valid keys: {', '.join(canonical)}"
    return message


def parse_section(cls, raw, source, path, key_homes=None):
    """Builds section `cls` from the JSON object `raw` found at `path` of config `source`."""
    if raw is None or raw == AUTO:
        raw = {}
    if not isinstance(raw, dict):
        fail(source, f"'{path}' must be a JSON object {{...}}, got {show(raw)}")
    if hasattr(cls, "translate_deprecated"):
        raw = cls.translate_deprecated(dict(raw), source, path)
    keys = accepted_keys(cls)
    default_only = getattr(cls, "DEFAULT_ONLY", {})
    values, spelled = {}, {}
    for key, value in raw.items():
        if key in default_only:
            check_default_only(key_path(path, key), value, default_only[key], source,
                               getattr(cls, "DEFAULT_ONLY_HINTS", {}).get(key))
            continue
        f = keys.get(key)
        if f is None:
            fail(source, unknown_key_message(key, path, cls, key_homes or {}))
        if f.name in spelled:
            fail(source, f"'{key_path(path, spelled[f.name])}' and '{key_path(path, key)}' "
                         "are two spellings of the same key; keep one")
        spelled[f.name] = key
        if isinstance(value, str) and value == AUTO:
            say_auto_default(source, key_path(path, key), "its default" if f.default is
                             dataclasses.MISSING else f"the default {show(f.default)}")
            continue
        values[f.name] = coerce(value, f, source, key_path(path, key), key_homes)
    for f in dataclasses.fields(cls):  # absent sections still get their defaults resolved
        tp, optional = _unwrap_optional(f.type)
        if f.name not in values and dataclasses.is_dataclass(tp) and not optional:
            values[f.name] = parse_section(tp, {}, source, key_path(path, f.name), key_homes)
    parsed = cls(**values)
    if hasattr(parsed, "check"):
        parsed.check(source, path)
    return parsed


def _unwrap_optional(tp):
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def coerce(value, f, source, path, key_homes=None):
    tp, optional = _unwrap_optional(f.type)
    if dataclasses.is_dataclass(tp):
        if value is None:
            return None if optional else tp()
        return parse_section(tp, value, source, path, key_homes)
    if value is None:
        if optional:
            return None
        fail(source, f"'{path}' must be {_kind_name(tp)}, got null")
    converted = _convert_scalar(value, tp, source, path)
    choices = f.metadata["choices"]
    if isinstance(converted, str) and choices and converted.lower() in choices:
        converted = converted.lower()  # "BF16": DeepSpeed lower-cases communication_data_type
    _check_range(converted, f.metadata, source, path)
    return converted


def _kind_name(tp):
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a JSON object {...}"}[tp]


def _convert_scalar(value, tp, source, path):
    wrong = f"'{path}' must be {_kind_name(tp)}, got {show(value)}"
    if tp is bool:
        if not isinstance(value, bool):
            fail(source, wrong)
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(source, wrong)
        if not math.isfinite(value):
            fail(source, f"'{path}' must be finite, got {show(value)}")
        if tp is float:
            return float(value)
        if value != int(value):  # 5e8 is fine, 2.5 is not
            fail(source, wrong)
        return int(value)
    if not isinstance(value, tp):
        fail(source, wrong)
    return value


def _check_range(value, metadata, source, path):
    choices = metadata["choices"]
    if choices is not None and value not in choices:
        allowed = ", ".join(show(c) for c in choices)
        fail(source, f"'{path}' must be one of {allowed}, got {show(value)}")
    minimum, maximum = metadata["minimum"], metadata["maximum"]
    if minimum is not None and value < minimum:
        fail(source, f"'{path}' must be >= {minimum}, got {show(value)}")
    if maximum is not None and value > maximum:
        fail(source, f"'{path}' must be <= {maximum}, got {show(value)}")


_AUTO_SAID = set()  # (source, path): said once per process, however often a config is parsed


def say_auto_default(source, path, used):
    """Hugging Face's "auto" is a value its Trainer (or pretrain_gpt2.py, from the flags)
    writes in before the config is read; one left for zero takes a default (`used`): said."""
    if (source, path) in _AUTO_SAID:
        return
    _AUTO_SAID.add((source, path))
    logger.warning("%s: '%s' is \"auto\", which nothing filled in: %s is used", source, path,
                   used)


def _same(value, default):
    # 0 == False in Python; a JSON 0 must not pass for false (or 1 for true)
    return isinstance(value, bool) == isinstance(default, bool) and value == default


def check_default_only(path, value, default, source, hint=None):
    """Accepts a key zero does not implement only when it asks for DeepSpeed's default;
    `hint` (the section's DEFAULT_ONLY_HINTS) says what the feature is and what runs here."""
    if isinstance(value, str) and value == AUTO:
        return
    said = f" ({hint})" if hint else ""
    if default is DISABLED_SECTION:
        if value is None or (isinstance(value, dict) and _same(value.get("enabled", False), False)):
            return
        fail(source, f"'{path}' enables a DeepSpeed feature that zero does not implement{said}; "
                     "remove the section or set \"enabled\": false")
    if isinstance(default, dict):
        if isinstance(value, dict) and all(k in default and _same(v, default[k])
                                           for k, v in value.items()):
            return
        fail(source, f"'{path}' = {show(value)} asks for DeepSpeed behaviour that zero does not "
                     f"implement{said}; remove it (accepted: only the defaults {show(default)})")
    if not _same(value, default):
        fail(source, f"'{path}' = {show(value)} asks for a DeepSpeed feature that zero does not "
                     f"implement{said}; remove the key (or set it to the default "
                     f"{show(default)})")


def deprecated_bool(raw, key, source, path):
    """Pops an old boolean spelling (e.g. `cpu_offload`); returns None when absent."""
    if key not in raw:
        return None
    value = raw.pop(key)
    if isinstance(value, str) and value == AUTO:
        return None
    if value is not None and not isinstance(value, bool):
        fail(source, f"'{key_path(path, key)}' must be true or false, got {show(value)}")
    return value


def collect_key_homes(cls, path="", homes=None):
    """{key: [section paths where it is valid]}, for 'this key belongs elsewhere' hints."""
    homes = {} if homes is None else homes
    for key in accepted_keys(cls):
        homes.setdefault(key, []).append(path)
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(f.type)
        if dataclasses.is_dataclass(tp):
            collect_key_homes(tp, key_path(path, f.name), homes)
    return homes
