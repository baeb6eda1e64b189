"""Checkpoint files of a run directory: atomic writes, checksums, safe loading, and the fallback on resume.

    checkpoints/step_XXXXXXXX.pt   the state after XXXXXXXX optimizer steps, as plain data only (tensors, numbers,
                                   strings, lists, tuples, dicts): model and optimizer state, scheduler, step, config,
                                   per-rank data positions and RNG states. Loaded with torch.load(weights_only=True),
                                   so a checkpoint from elsewhere cannot run code.
    checkpoints/latest.json        {"format", "file", "step", "sha256", "kept": [{"file", "step", "sha256"}, ...]}:
                                   the newest checkpoint, and every kept one with the sha256 of its bytes (oldest first)

Every file is written to a temporary name, fsynced, renamed over the old one (os.replace), and then its directory
is fsynced, so a crash at any point leaves either the old or the new file, never a partial one, and the rename
itself survives a power loss. On resume the newest kept checkpoint is used unless it fails to load or does not
match its sha256; then the failure is reported and the previous kept one is tried. An unreadable latest.json is
reported and the step_*.pt files on disk are tried instead, newest first.

These functions take the state as a dict and know nothing of the model or of distributed training, so a sharded
save (one file per rank) can reuse the same write, checksum and fallback rules.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.json"
FORMAT = 2  # the layout of a step_*.pt file (plain data, weights_only); 1 was a pickle loaded without that guard
NAME = re.compile(r"step_(\d{8})\.pt")
REQUIRED_KEYS = ("format", "step", "config_hash", "config", "model", "optimizer", "scheduler", "data", "rng")


class CheckpointError(InputError, RuntimeError):
    """A checkpoint or latest.json cannot be used (the message says which file and why)."""


@dataclass(frozen=True)
class CheckpointEntry:
    file: str  # step_XXXXXXXX.pt, inside the checkpoint directory
    step: int  # optimizer steps done when it was written
    sha256: str | None  # of the file's bytes as written; None for a file found on disk without latest.json

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "step": self.step, "sha256": self.sha256}


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    _replace_durably(tmp, path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_torch_save(obj: Any, path: Path) -> str:
    """torch.save through a fsynced temporary file and a durable rename; returns the sha256 of the bytes on disk."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    digest = sha256_file(tmp)
    _replace_durably(tmp, path)
    return digest


# -- latest.json ---------------------------------------------------------------------------------------------
def _entry(item: Any, where: str) -> CheckpointEntry:
    if not isinstance(item, dict):
        raise CheckpointError(f"{where} is not an object")
    name, step, digest = item.get("file"), item.get("step"), item.get("sha256")
    match = NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise CheckpointError(f"{where}.file must name a step_XXXXXXXX.pt file of the checkpoint directory, got "
                              f"{name!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step != int(match.group(1)):
        raise CheckpointError(f"{where}.step must be the step in its file name ({int(match.group(1))}), got {step!r}")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise CheckpointError(f"{where}.sha256 must be 64 hex digits, got {digest!r}")
    return CheckpointEntry(name, step, digest)


def read_latest(ckpt_dir: Path) -> list[CheckpointEntry]:
    """The kept checkpoints latest.json lists, oldest first (its "file" last); CheckpointError if it is invalid."""
    path = ckpt_dir / LATEST
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold an object, got {type(data).__name__}")
    newest = _entry(data, str(path))
    kept_raw = data.get("kept", [data])  # a latest.json of format 1 names only the newest file
    if not isinstance(kept_raw, list) or not kept_raw:
        raise CheckpointError(f"{path}: 'kept' must be a non-empty list")
    kept = [_entry(item, f"{path} kept[{i}]") for i, item in enumerate(kept_raw)]
    if kept[-1].file != newest.file:
        raise CheckpointError(f"{path} names {newest.file} as the newest but its kept list ends with {kept[-1].file}")
    if [e.step for e in kept] != sorted({e.step for e in kept}):
        raise CheckpointError(f"{path}: the kept checkpoints must be in increasing step order")
    if newest.sha256 is None and "kept" in data:
        raise CheckpointError(f"{path} gives no sha256 for {newest.file}")
    return kept


def write_latest(ckpt_dir: Path, kept: list[CheckpointEntry]) -> None:
    newest = kept[-1]
    atomic_write_bytes(ckpt_dir / LATEST, json.dumps({"format": FORMAT, **newest.as_dict(),
                                                      "kept": [e.as_dict() for e in kept]}, indent=1).encode())


def on_disk(ckpt_dir: Path) -> list[CheckpointEntry]:
    """step_XXXXXXXX.pt files in the directory, oldest first (no checksum known)."""
    found = [(int(m.group(1)), p.name) for p in ckpt_dir.glob("step_*.pt") if (m := NAME.fullmatch(p.name))]
    return [CheckpointEntry(name, step, None) for step, name in sorted(found)]


def has_checkpoint(run_dir: Path) -> bool:
    ckpt_dir = run_dir / CHECKPOINT_DIR
    return (ckpt_dir / LATEST).exists() or bool(on_disk(ckpt_dir)) if ckpt_dir.is_dir() else False


def resume_candidates(run_dir: Path) -> tuple[list[CheckpointEntry], list[str]]:
    """(checkpoints to try, newest first; problems to report). latest.json decides; where it is missing or invalid
    the files on disk are used and the problem is reported."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return [], []
    problems: list[str] = []
    if (ckpt_dir / LATEST).exists():
        try:
            return list(reversed(read_latest(ckpt_dir))), problems
        except CheckpointError as exc:
            problems.append(str(exc))
    files = on_disk(ckpt_dir)
    if files:
        problems.append(f"{ckpt_dir / LATEST} is missing or invalid: trying the {len(files)} checkpoint file(s) on "
                        f"disk, newest first")
    return list(reversed(files)), problems


# -- one checkpoint ------------------------------------------------------------------------------------------
def load_checkpoint(ckpt_dir: Path, entry: CheckpointEntry) -> dict[str, Any]:
    """The state dict of one checkpoint file, checked against its sha256 and loaded with weights_only=True."""
    path = ckpt_dir / entry.file
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if entry.sha256 is not None:
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise CheckpointError(f"{path} does not match its sha256 in {LATEST} (written {entry.sha256[:16]}..., "
                                  f"now {actual[:16]}...): the file changed or was cut short after it was written")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, ...: torch raises many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path} cannot be loaded as plain data (weights_only=True): {type(exc).__name__}: "
                              f"{first[:300]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: not a checkpoint of this trainer")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {state['format']!r}, this trainer reads {FORMAT}")
    if state["step"] != entry.step:
        raise CheckpointError(f"{path} holds step {state['step']!r}, its name says {entry.step}")
    return state


def write_checkpoint(ckpt_dir: Path, state: dict[str, Any], kept: list[CheckpointEntry],
                     keep: int) -> list[CheckpointEntry]:
    """Write `state` (with "step") as step_XXXXXXXX.pt, point latest.json at it, delete checkpoints no longer
    kept (the newest `keep`, and any file latest.json does not list). Returns the new kept list."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    name = checkpoint_name(step)
    digest = atomic_torch_save({"format": FORMAT, **state}, ckpt_dir / name)
    kept = [e for e in kept if e.step < step] + [CheckpointEntry(name, step, digest)]
    kept = kept[-keep:]
    write_latest(ckpt_dir, kept)
    names = {e.file for e in kept}
    removed = False
    for entry in on_disk(ckpt_dir):
        if entry.file not in names:
            (ckpt_dir / entry.file).unlink(missing_ok=True)
            removed = True
    if removed:
        fsync_dir(ckpt_dir)
    return kept
