"""Which code is this: the git commit (or the one given for a copied tree without .git) and a digest of the
source files that a launch runs and the gates test, so that a GO record names exactly what was checked."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("reference", "optimized", "sentinels", "conformance", "configs")  # what the gates test and run
SOURCE_FILES = ("pyproject.toml", "noxfile.py", "constraints-cpu.txt")
SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".txt", ".json")


@dataclass(frozen=True)
class CodeIdentity:
    commit: str | None  # None when neither git nor --commit tells it
    commit_source: str  # "git" | "given" (--commit, for a copied tree without .git) | "unknown"
    dirty: bool | None  # tracked files modified (git status --porcelain --untracked-files=no); None without git
    source_digest: str  # sha256 over the relative paths and bytes of the source files (source_files())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files the digest covers, sorted: SOURCE_FILES and every SOURCE_SUFFIXES file under SOURCE_DIRS."""
    files = [root / name for name in SOURCE_FILES if (root / name).is_file()]
    for top in SOURCE_DIRS:
        for path in (root / top).rglob("*"):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_digest(root: Path = REPO_ROOT) -> str:
    digest = hashlib.sha256()
    for path in source_files(root):
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        digest.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_identity(root: Path = REPO_ROOT, given_commit: str | None = None) -> CodeIdentity:
    """The commit from git; `given_commit` only where git cannot tell (a copied tree), and it must agree when
    both exist (ValueError otherwise)."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    if commit is not None and given_commit is not None and not commit.startswith(given_commit):
        raise ValueError(f"--commit {given_commit} disagrees with the checkout's git commit {commit}")
    if commit is not None:
        source = "git"
    elif given_commit:
        commit, source = given_commit, "given"
    else:
        source = "unknown"
    return CodeIdentity(commit=commit, commit_source=source, dirty=None if status is None else bool(status),
                        source_digest=source_digest(root))
