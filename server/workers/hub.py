"""Where a model's files are: a local directory, or a Hugging Face hub id resolved to its
snapshot in the Hugging Face cache (downloaded there first when online), as ``vllm serve``
takes either.

Resolution runs in the worker that loads the model (a spawned or a listening worker alike:
each resolves its own, with its own environment and cache). ``huggingface_hub``'s
``snapshot_download`` honours ``HF_HOME``/``HF_HUB_CACHE``, ``HF_TOKEN`` and
``HF_HUB_OFFLINE``; ``revision`` picks a branch, tag or commit. Every failure is one line
(a ``FileNotFoundError`` or ``RuntimeError``), which the server prints before it exits.

Example::

    path, hub_id = model_files("Qwen/Qwen2.5-0.5B-Instruct")   # (snapshot dir, the id)
    path, hub_id = model_files("/models/qwen")                  # (the directory, None)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .base import one_line

__all__ = ["model_files"]

#: What the hub accepts as a repository id: ``name`` or ``owner/name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")

#: Files a model server never reads (other frameworks' weights, vLLM's own skip list).
_IGNORE = ["original/*", "*.pth", "*.pt", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data",
           "*.tflite", "*.ot", "*.gguf"]


def model_files(model: str, *, revision: str | None = None) -> tuple[Path, str | None]:
    """``(directory, hub id or None)`` of ``model``: an existing local path as it is (a
    ``revision`` is then refused: it names a hub revision), else a hub id's snapshot."""
    path = Path(model).expanduser()
    if path.exists() or not _HUB_ID.fullmatch(model) or model.startswith("."):
        if revision is not None:
            raise ValueError(f"revision {revision!r} names a hub revision, but {model} is a "
                             "local path")
        if not path.exists():
            raise FileNotFoundError(f"model directory {path} does not exist")
        return path, None
    return _snapshot(model, revision), model


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    # The environment as it is now (huggingface_hub reads it once, when first imported).
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        found = snapshot_download(
            repo_id, revision=revision, ignore_patterns=_IGNORE, cache_dir=_cache_dir(),
            local_files_only=offline, token=os.environ.get("HF_TOKEN") or None,
        )
        return Path(str(found))
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if offline else "the hub could not be reached")
        raise FileNotFoundError(
            f"model {repo_id}{at} is neither a local directory nor in the Hugging Face cache, "
            f"and {why}"
        ) from None
    except GatedRepoError:
        raise RuntimeError(f"model {repo_id} is gated: accept its terms on the hub and set "
                           "HF_TOKEN") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo_id} has no revision {revision}") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id} is neither a local directory nor a hub repository (or it is "
            "private: set HF_TOKEN)"
        ) from None
    except Exception as exc:
        raise RuntimeError(f"cannot download model {repo_id}{at}: {one_line(exc)}") from None


def _cache_dir() -> str:
    """The hub cache that ``HF_HUB_CACHE`` or ``HF_HOME`` name now (huggingface_hub's
    default places)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")
