"""Reading a run config: defaults < a TOML or JSON file (with `extends`) < `section.field=value`
overrides; writing one back as TOML; taking the coordinator's model and task sections."""

from __future__ import annotations

import json
import tomllib
import typing
from pathlib import Path

from pydantic import BaseModel, ValidationError

from decentrl.config.base import ConfigError
from decentrl.config.checks import check_together
from decentrl.config.run import RunConfig

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
"""The demo's settings (package data): `decentrl demo` without `--config`, `--config demo` for any
role, and `extends = "demo"`."""

PACKAGED_CONFIGS = {"demo": DEMO_CONFIG}
"""Configs shipped in the package, named by `--config NAME` and `extends = "NAME"` (a file of that
name, if there is one, comes first)."""


def _parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value, e.g. trainer.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes: model.path=/some/dir
    return key.strip().split("."), value


def _set_path(tree: dict, path: list[str], value: object) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{'.'.join(path)}': '{part}' is a value, not a section")
    node[path[-1]] = value


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if not _is_variant_tag(p, first["loc"]))
    if first["type"] == "extra_forbidden":
        section = _section_of(first["loc"][:-1])
        valid = ", ".join(sorted(section.model_fields)) if section else ""
        return f"unknown config key '{where}'; valid keys here: {valid}"
    if first["type"] == "union_tag_invalid":
        context = first.get("ctx", {})
        return f"config '{where}': {context.get('tag')!r} is not a known name; choose one of {context.get('expected_tags')}"
    return f"config '{where}': {first['msg']} (got {first.get('input')!r})"


def _is_variant_tag(part: object, loc: tuple) -> bool:
    """True for the variant name pydantic inserts into the location of a discriminated union."""
    index = loc.index(part)
    return index > 0 and _section_of(loc[:index]) is None and _section_of(loc[: index + 1]) is not None


def _section_of(loc: tuple) -> type[BaseModel] | None:
    """The model at `loc`; a discriminated union (the algorithm variants) is resolved by the tag
    pydantic puts in the location after the field name."""
    model: type[BaseModel] = RunConfig
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
            continue
        variants = {v.model_fields["name"].default: v for v in typing.get_args(field.annotation)}
        if not parts or parts[0] not in variants:
            return None
        model = variants[parts.pop(0)]
    return model


def _read_tree(path: Path | None, seen: tuple[Path, ...] = ()) -> tuple[str, dict]:
    if path is None:
        return "defaults", {}
    if not path.is_file() and str(path) in PACKAGED_CONFIGS:
        path = PACKAGED_CONFIGS[str(path)]
    if not path.is_file():
        names = ", ".join(PACKAGED_CONFIGS)
        raise ConfigError(
            f"config file {str(path)!r} not found; pass an existing .toml, a packaged config ({names}) or omit --config"
        )
    try:
        # JSON is accepted too: launchers hand each role the exact resolved config that way.
        text = path.read_text()
        tree = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path}: invalid {path.suffix[1:].upper()} ({exc}); fix the file's syntax"
        ) from None
    base = tree.pop("extends", None)
    if base is None:
        return path.name, tree
    # `extends = "../base.toml"`: start from another file (relative to this one), then this file's
    # keys; `extends = "demo"` names the demo config shipped with the package.
    base_path = PACKAGED_CONFIGS.get(str(base)) or (path.parent / str(base)).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: 'extends' makes a cycle through {base_path}; remove one of them")
    _, base_tree = _read_tree(base_path, (*seen, path.resolve()))
    return path.name, _merge(base_tree, tree)


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section; a variant whose `name` changes replaces the base's."""
    merged = dict(base)
    for key, value in top.items():
        old = merged.get(key)
        same_variant = not (isinstance(old, dict) and isinstance(value, dict)) or old.get(
            "name"
        ) == value.get("name", old.get("name"))
        if isinstance(old, dict) and isinstance(value, dict) and same_variant:
            merged[key] = _merge(old, value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    fields: dict[str, object] | None = None,
) -> RunConfig:
    """Defaults < the file at `path` (none when None) < `overrides` (`section.field=value`
    strings, the value parsed as TOML: `--set`) < `fields` (dotted names to values, as given:
    what a command's own flags set, e.g. `{"trainer.nproc": 2}`)."""
    name, tree = _read_tree(Path(path) if path is not None else None)
    for text in overrides or []:
        key, value = _parse_override(text)
        _set_path(tree, key, value)
    for key, value in (fields or {}).items():
        _set_path(tree, key.split("."), value)
    _name_default_variants(tree, RunConfig)
    try:
        config = RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(f"{name}: {_describe(exc)}") from None
    check_together(config)
    return config


def _name_default_variants(tree: dict, model: type[BaseModel]) -> None:
    """A variant section set without its `name` (`--set algorithm.correction.cap=3` on the
    defaults) refers to the default variant: fill in that variant's name."""
    for key, field in model.model_fields.items():
        value = tree.get(key)
        if not isinstance(value, dict):
            continue
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            _name_default_variants(value, field.annotation)
        elif isinstance(field.default, BaseModel) and "name" in type(field.default).model_fields:
            value.setdefault("name", field.default.model_dump()["name"])  # checked just above


def dump_toml(tree: dict, prefix: str = "") -> str:
    """`tree` (a JSON-like dump of a config) as TOML that `load_config` reads back to the same
    values: a table's plain values first, then its sub-tables as `[section.sub]` headers."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in tree.items() if not _is_table(value)]
    for key, value in tree.items():
        if _is_table(value):
            name = f"{prefix}{key}"
            lines += ["", f"[{name}]", dump_toml(value, name + ".")]
    return "\n".join(line for line in lines if line != "" or lines).strip("\n")


def documented_toml(config: BaseModel, prefix: str = "") -> str:
    """`config` as TOML with each field's docstring above it as comments (`decentrl config show
    --docs`); an unset (None) field is shown commented out. Reads back like `dump_toml`'s output."""
    values = config.model_dump(mode="json")
    fields = type(config).model_fields
    tables = [name for name in fields if isinstance(getattr(config, name), BaseModel)]
    lines: list[str] = []
    for name, field in fields.items():
        if name in tables:
            continue
        lines += [f"# {line}".rstrip() for line in (field.description or "").splitlines()]
        value = _without_none(values[name])
        lines.append(f"# {name} = (unset)" if value is None else f"{name} = {_toml_value(value)}")
    for name in tables:
        path = f"{prefix}{name}"
        lines += ["", f"[{path}]", documented_toml(getattr(config, name), path + ".")]
    return "\n".join(lines).strip("\n")


def _without_none(value: object) -> object:
    """TOML has no null: unset fields inside a value are left out, as `exclude_none` does."""
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


def _is_table(value: object) -> bool:
    return isinstance(value, dict) and bool(value)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):  # an inline table (an empty one, or one inside a list)
        return "{" + ", ".join(f"{key} = {_toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(value)  # numbers, and strings in TOML's basic-string syntax


COORDINATOR_SECTIONS = ("model", "task", "sft")
"""Sections a trainer or verifier takes from the coordinator's `/v1/info`: what the run trains
(the model, or the recipe of the tiny one and its warm start) and on which task."""


def adopt_coordinator_sections(config: RunConfig, sections: dict[str, dict], role: str) -> RunConfig:
    """`config` with the coordinator's model, task and warm-start sections. A section the role
    left at its defaults is taken as the coordinator has it; one set to something else is a
    ConfigError naming the difference (two parts of one run must agree on what they train)."""
    update = {}
    for name in COORDINATOR_SECTIONS:
        if name not in sections:
            continue
        section_type = type(getattr(config, name))
        theirs = section_type.model_validate(sections[name])
        ours = getattr(config, name)
        if ours != theirs and ours != section_type():
            differing = [
                f"{name}.{key} = {getattr(ours, key)!r} (coordinator: {getattr(theirs, key)!r})"
                for key in section_type.model_fields
                if getattr(ours, key) != getattr(theirs, key)
            ]
            raise ConfigError(
                f"the {role}'s [{name}] differs from the coordinator's: {'; '.join(differing[:3])}; "
                f"drop [{name}] from the {role}'s config or start it with the coordinator's"
            )
        update[name] = theirs
    return config.model_copy(update=update)
