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

A sharded checkpoint (train.parallel fsdp) is a directory with the same name rules and the same guarantees:

    checkpoints/step_XXXXXXXX.dcp/state.pt       what step_XXXXXXXX.pt holds except the model's and the optimizer's
                                                 tensors (their hyperparameters stay, as plain numbers)
    checkpoints/step_XXXXXXXX.dcp/tensors/       those tensors as torch.distributed.checkpoint writes them: one file
                                                 of shards per rank and an index (.metadata), loadable on any number
                                                 of ranks
    checkpoints/step_XXXXXXXX.dcp/manifest.json  every other file of the directory with its size and sha256

Every rank writes its shards into step_XXXXXXXX.dcp.tmp/; rank 0 then writes state.pt and the manifest, fsyncs,
and renames the directory into place, so a crash leaves no directory under the final name. latest.json holds the
sha256 of the manifest; loading checks it, every file against the manifest, and that the index (a pickle, which
torch.distributed.checkpoint loads without weights_only) names only allowed classes and tensor items, before
anything is read with torch.distributed.checkpoint.

These functions take the state as a dict and know nothing of the model or of distributed training; the
collective write and read of the shards is sentinels/distributed.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.json"
FORMAT = 2  # the layout of a step_*.pt file (plain data, weights_only); 1 was a pickle loaded without that guard
NAME = re.compile(r"step_(\d{8})\.(pt|dcp)")
REQUIRED_KEYS = ("format", "step", "config_hash", "config", "model", "optimizer", "scheduler", "data", "rng")
SHARDED = ".dcp"
MANIFEST = "manifest.json"
STATE = "state.pt"
TENSORS = "tensors"
SHARDED_REQUIRED_KEYS = ("format", "step", "config_hash", "config", "optimizer_plain", "scheduler", "data", "rng")


class CheckpointError(InputError, RuntimeError):
    """A checkpoint or latest.json cannot be used (the message says which file and why)."""


@dataclass(frozen=True)
class CheckpointEntry:
    file: str  # step_XXXXXXXX.pt (or the directory step_XXXXXXXX.dcp), inside the checkpoint directory
    step: int  # optimizer steps done when it was written
    sha256: str | None  # of the file's bytes as written (of a directory's manifest); None if found without latest.json

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "step": self.step, "sha256": self.sha256}

    @property
    def sharded(self) -> bool:
        return self.file.endswith(SHARDED)


def checkpoint_name(step: int, sharded: bool = False) -> str:
    return f"step_{step:08d}{SHARDED if sharded else '.pt'}"


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
        raise CheckpointError(f"{where}.file must name a step_XXXXXXXX.pt file (or step_XXXXXXXX.dcp directory) of "
                              f"the checkpoint directory, got {name!r}")
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
    """step_XXXXXXXX.pt files and step_XXXXXXXX.dcp directories in the directory, oldest first (no checksum known)."""
    found = [(int(m.group(1)), p.name) for p in ckpt_dir.glob("step_*")
             if (m := NAME.fullmatch(p.name)) and (p.is_dir() if p.name.endswith(SHARDED) else p.is_file())]
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
    """The state dict of one checkpoint file, checked against its sha256 and loaded with weights_only=True (of a
    sharded checkpoint: its state.pt, after the checks of load_sharded_checkpoint)."""
    if entry.sharded:
        return load_sharded_checkpoint(ckpt_dir, entry)
    path = ckpt_dir / entry.file
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if entry.sha256 is not None:
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise CheckpointError(f"{path} does not match its sha256 in {LATEST} (written {entry.sha256[:16]}..., "
                                  f"now {actual[:16]}...): the file changed or was cut short after it was written")
    return _load_plain_state(path, REQUIRED_KEYS, entry.step)


def _load_plain_state(path: Path, required: tuple[str, ...], step: int) -> dict[str, Any]:
    """A state dict saved by this module, loaded with weights_only=True and checked: its keys, format and step."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, ...: torch raises many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path} cannot be loaded as plain data (weights_only=True): {type(exc).__name__}: "
                              f"{first[:300]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint")
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: not a checkpoint of this trainer")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {state['format']!r}, this trainer reads {FORMAT}")
    if state["step"] != step:
        raise CheckpointError(f"{path} holds step {state['step']!r}, its name says {step}")
    return state


def write_checkpoint(ckpt_dir: Path, state: dict[str, Any], kept: list[CheckpointEntry],
                     keep: int) -> list[CheckpointEntry]:
    """Write `state` (with "step") as step_XXXXXXXX.pt, point latest.json at it, delete checkpoints no longer
    kept (the newest `keep`, and any file latest.json does not list). Returns the new kept list."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    name = checkpoint_name(step)
    digest = atomic_torch_save({"format": FORMAT, **state}, ckpt_dir / name)
    return _keep(ckpt_dir, kept, CheckpointEntry(name, step, digest), keep)


def _keep(ckpt_dir: Path, kept: list[CheckpointEntry], new: CheckpointEntry, keep: int) -> list[CheckpointEntry]:
    """Point latest.json at `new`, keep the newest `keep`, delete every other checkpoint (and unfinished ones)."""
    kept = ([e for e in kept if e.step < new.step] + [new])[-keep:]
    write_latest(ckpt_dir, kept)
    names = {e.file for e in kept}
    removed = False
    for entry in on_disk(ckpt_dir):
        if entry.file not in names:
            _remove(ckpt_dir / entry.file)
            removed = True
    for leftover in ckpt_dir.glob(f"step_*{SHARDED}.*"):  # a sharded write cut short (.tmp) or replaced (.old)
        _remove(leftover)
        removed = True
    if removed:
        fsync_dir(ckpt_dir)
    return kept


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# -- a sharded checkpoint (a directory) ------------------------------------------------------------------------
def sharded_tmp_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / (checkpoint_name(step, sharded=True) + ".tmp")


def begin_sharded_checkpoint(ckpt_dir: Path, step: int) -> Path:
    """(Rank 0, before any rank writes.) An empty step_XXXXXXXX.dcp.tmp/tensors/ for the ranks' shards; a
    leftover of a write cut short is removed. Returns the tensors directory."""
    tmp = sharded_tmp_dir(ckpt_dir, step)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _remove(tmp)
    (tmp / TENSORS).mkdir(parents=True)
    return tmp / TENSORS


def _files_under(root: Path) -> dict[str, Path]:
    """Every file below root by its relative POSIX path; a symbolic link or anything but files and directories is
    refused."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise CheckpointError(f"{path}: a checkpoint directory holds only plain files and directories")
        if path.is_file():
            files[path.relative_to(root).as_posix()] = path
    return files


def _fsync_file(path: Path) -> None:
    with path.open("rb") as fh:
        os.fsync(fh.fileno())


def finish_sharded_checkpoint(ckpt_dir: Path, state: dict[str, Any], kept: list[CheckpointEntry],
                              keep: int) -> list[CheckpointEntry]:
    """(Rank 0, after every rank wrote its shards with begin_sharded_checkpoint's directory.) Write state.pt (with
    "step") and the manifest, fsync everything, rename the directory to step_XXXXXXXX.dcp, point latest.json at it
    and delete checkpoints no longer kept, as write_checkpoint does. Returns the new kept list."""
    step = int(state["step"])
    name = checkpoint_name(step, sharded=True)
    tmp = sharded_tmp_dir(ckpt_dir, step)
    missing = [key for key in SHARDED_REQUIRED_KEYS if key != "format" and key not in state]
    if missing:
        raise ValueError(f"finish_sharded_checkpoint: the state lacks {missing}")
    atomic_torch_save({"format": FORMAT, **state}, tmp / STATE)
    files = {}
    for rel, path in _files_under(tmp).items():
        _fsync_file(path)
        files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    fsync_dir(tmp / TENSORS)
    manifest = json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1, sort_keys=True).encode()
    atomic_write_bytes(tmp / MANIFEST, manifest)
    final = ckpt_dir / name
    if final.exists():  # the same step written again: the old directory goes after the new one is in place
        old = final.with_name(name + ".old")
        _remove(old)
        os.replace(final, old)
    _replace_durably(tmp, final)
    return _keep(ckpt_dir, kept, CheckpointEntry(name, step, hashlib.sha256(manifest).hexdigest()), keep)


def sharded_tensors_dir(ckpt_dir: Path, entry: CheckpointEntry) -> Path:
    return ckpt_dir / entry.file / TENSORS


_INDEX_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                  ("builtins", "set"), ("builtins", "frozenset"),
                  ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_INDEX_PATH_MODULES = ("pathlib", "pathlib._local")
_INDEX_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath")


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a torch.distributed.checkpoint index only: its metadata dataclasses, torch.Size, dtypes, layouts
    and paths. Anything else (a function to call, another class) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        import torch.distributed.checkpoint.metadata as dcp_metadata

        allowed = ((module, name) in _INDEX_GLOBALS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
                   or (module in _INDEX_PATH_MODULES and name in _INDEX_PATH_CLASSES)
                   or (module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint index")
        return super().find_class(module, name)


def check_tensor_index(path: Path) -> None:
    """CheckpointError unless the torch.distributed.checkpoint index at `path` unpickles with the allowed classes
    only and lists tensors only (a non-tensor item would be read with torch.load(weights_only=False))."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        with path.open("rb") as fh:
            index = _IndexUnpickler(fh).load()
        items = index.state_dict_metadata
    except Exception as exc:  # unpickling errors of many types; a refused class among them
        raise CheckpointError(f"{path} is not a plain torch.distributed.checkpoint index: {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:300]}") from None
    foreign = sorted(key for key, item in items.items() if not isinstance(item, TensorStorageMetadata))
    if foreign:
        raise CheckpointError(f"{path} lists items that are not tensors ({', '.join(foreign[:5])}): this trainer "
                              f"writes tensors only, and loading other items could run code")


def load_sharded_checkpoint(ckpt_dir: Path, entry: CheckpointEntry) -> dict[str, Any]:
    """The plain state (state.pt) of a sharded checkpoint, after checking the manifest against its sha256 in
    latest.json, every file against the manifest (none missing, none added), and the tensor index
    (check_tensor_index); loaded with weights_only=True. The tensors are then read by every rank."""
    root = ckpt_dir / entry.file
    if not root.is_dir():
        raise CheckpointError(f"{root} does not exist")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{root} has no {MANIFEST}: the checkpoint was not finished")
    raw = manifest_path.read_bytes()
    if entry.sha256 is not None and hashlib.sha256(raw).hexdigest() != entry.sha256:
        raise CheckpointError(f"{manifest_path} does not match its sha256 in {LATEST}: the checkpoint changed after "
                              f"it was written")
    try:
        listed = json.loads(raw)["files"]
        expected = {str(rel): (int(info["bytes"]), str(info["sha256"])) for rel, info in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{manifest_path} is not a manifest ({type(exc).__name__}: {exc})") from None
    found = _files_under(root)
    found.pop(MANIFEST, None)
    if set(found) != set(expected):
        missing, added = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise CheckpointError(f"{root} does not hold the files its manifest lists (missing {missing}, not listed "
                              f"{added})")
    for rel, path in found.items():
        size, digest = expected[rel]
        if path.stat().st_size != size or sha256_file(path) != digest:
            raise CheckpointError(f"{path} does not match its sha256 in {MANIFEST}: the file changed or was cut "
                                  f"short after it was written")
    check_tensor_index(root / TENSORS / ".metadata")
    return _load_plain_state(root / STATE, SHARDED_REQUIRED_KEYS, entry.step)
