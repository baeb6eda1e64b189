"""The conventions a run checks: a preset (reference/config.py PRESETS), then a small config file, then
`--set switch=value` options. Only the NSAConfig convention switches can be set (phi, window_keys,
cmp_visibility, selection_score, group_reduce): sizes are drawn by the strategies inside the implementation's
declared capabilities, and a preset with l = d = l' (equal_blocks) makes them draw equal blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from conformance.adapters.capabilities import CONVENTIONS
from reference.config import PRESETS, NSAConfig

DEFAULT_PRESET = "paper"


class ConventionError(ValueError):
    """A bad --preset / --set / --config value (one line naming the option and the rule)."""


@dataclass(frozen=True)
class Conventions:
    preset: str
    config: NSAConfig
    changes: dict = field(default_factory=dict)  # switch -> value set on top of the preset
    source: str = ""  # how they were given, for the report

    def describe(self) -> dict:
        return {"preset": self.preset, "changes": dict(self.changes), "source": self.source,
                **{name: getattr(self.config, name) for name in CONVENTIONS}}


def parse_set(option: str) -> tuple[str, str]:
    if "=" not in option:
        raise ConventionError(f"--set {option!r}: expected SWITCH=VALUE, e.g. --set phi=avg")
    key, value = (part.strip() for part in option.split("=", 1))
    return key, value


def read_config_file(path: str) -> dict:
    """The mapping in a YAML or JSON file: optional 'preset', then switch: value."""
    file = Path(path)
    if not file.is_file():
        raise ConventionError(f"--config {path}: no such file")
    text = file.read_text()
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConventionError(f"--config {path}: not valid {'JSON' if file.suffix == '.json' else 'YAML'}: "
                              f"{' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict) or not data:
        raise ConventionError(f"--config {path}: expected a mapping of 'preset' and convention switches")
    return data


def checked_conventions(preset: str | None, config_file: str | None, sets: list[str]) -> Conventions:
    changes: dict = {}
    source = []
    from_file = read_config_file(config_file) if config_file else {}
    file_preset = from_file.pop("preset", None)
    name = preset or file_preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ConventionError(f"preset {name!r} (from --config {config_file}): known presets are {sorted(PRESETS)}")
    source.append(f"--preset {name}")
    if config_file:
        source.append(f"--config {config_file}")
    for key, value in from_file.items():
        changes[_switch(key, f"--config {config_file}")] = value
    for option in sets:
        key, value = parse_set(option)
        changes[_switch(key, "--set")] = value
        source.append(f"--set {key}={value}")
    for key, value in changes.items():
        if value not in CONVENTIONS[key]:
            raise ConventionError(f"{key}={value!r}: NSAConfig.{key} must be one of {CONVENTIONS[key]}")
    return Conventions(name, PRESETS[name].replace(**changes), changes, " ".join(source))


def _switch(key: str, where: str) -> str:
    if key not in CONVENTIONS:
        raise ConventionError(f"{where} {key!r}: only the convention switches {sorted(CONVENTIONS)} can be set "
                              "(sizes are drawn inside the implementation's declared capabilities)")
    return key
