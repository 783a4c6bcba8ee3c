"""Where zerolm's files live: a local path or a `gs://bucket/prefix` URL, through one storage layer.

Three clients reach Google Cloud Storage, each for what it does best, and all three find a GCS
emulator through their standard variables (`STORAGE_EMULATOR_HOST`, and `TENSORSTORE_GCS_HTTP_URL`
for TensorStore) and credentials through Google's application default credentials (a TPU VM's
service account, `GOOGLE_APPLICATION_CREDENTIALS`, or `gcloud auth application-default login`):
  - files (manifests, shards, metadata, the compilation cache) go through `etils.epath`, which reaches
    gs:// through fsspec's `gcsfs`; `path()` gives such a path for any location;
  - orbax writes checkpoint arrays through TensorStore's own GCS driver;
  - the run lock's lease needs the one thing neither offers, a write that succeeds only if the object
    is still the version last seen (GCS generations, `ifGenerationMatch`): `Versioned`, through
    `google-cloud-storage`.
Each retries transient failures (HTTP 5xx, 429, dropped connections) itself, with backoff.

GCS has no rename and no append. A file that must appear whole is written as one object, which GCS
makes atomic (`write_atomic`), and nothing here renames on gs:// (gcsfs would try its `moveTo` call,
then copy and delete).

Errors: a location that cannot be used (no bucket, a bucket that does not exist, no permission, an
endpoint that does not answer) is a `StorageError`, found by `check` before any work and reported in
one line naming the location (exit code 2); storage that fails while a run is under way is a
`StorageFault` (exit code 74, as a full disk).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

# gcsfs 2026.x asks every bucket for its "storage layout" (zonal, hierarchical) through a gRPC control
# API before using it: on a bucket of either kind zerolm does not need, and against an emulator it
# fails, each time with a warning, or hangs where Google's endpoints are out of reach. Off, unless the
# user says otherwise. TensorFlow, when installed, would otherwise take over gs:// paths in etils.epath
# (tf.io.gfile knows no emulator): gcsfs serves them either way.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("EPATH_USE_TF", "false")

import fsspec  # noqa: E402
from etils import epath  # noqa: E402  (after the variables above: gcsfs reads them when imported)

from zerolm.core.errors import ZerolmError, first_line  # noqa: E402
from zerolm.core.exitcodes import EXIT_STORAGE  # noqa: E402

# gcsfs caches directory listings for good by default, so what another process (another host of the run,
# or a run before this one in the same process) wrote or deleted would go unseen: zerolm lists rarely,
# and must see the bucket as it is.
for _protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(_protocol, {})["use_listings_cache"] = False

GS = "gs://"
# What the preflight check waits, at most, for an endpoint to answer (the clients' own retries in a run
# wait longer: a transient fault there must not stop a run).
CHECK_DEADLINE_S = 10.0
# Bucket names: 3-63 characters of lowercase letters, digits, dashes, underscores and dots.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")


class StorageError(ZerolmError):
    """A location that cannot be used; one line naming it and the cause."""


class StorageFault(ZerolmError):
    """Storage that failed during a run (an endpoint gone, a write refused); one line naming the location."""

    exit_code = EXIT_STORAGE


def is_remote(location: str | os.PathLike) -> bool:
    return "://" in str(location)


def path(location: str | os.PathLike) -> epath.Path:
    """An epath for a local path (made absolute: orbax and TensorStore need it) or a URL."""
    location = str(location)
    return epath.Path(location if is_remote(location) else os.path.abspath(location))


def split_gs(location: str) -> tuple[str, str]:
    """`gs://bucket/a/b` -> ("bucket", "a/b"); StorageError naming the location if it has no valid bucket."""
    if not location.startswith(GS):
        raise StorageError(f"{location}: not a gs:// URL")
    bucket, _, prefix = location[len(GS):].partition("/")
    if not bucket:
        raise StorageError(f"{location}: no bucket in the URL (expected gs://BUCKET/PATH)")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise StorageError(f"{location}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, "
                           "dashes, underscores or dots)")
    return bucket, prefix.strip("/")


def check(location: str | os.PathLike, what: str, *, local_only: str | None = None, read_only: bool = False) -> None:
    """Before any work: a location can be used. Local paths are checked where they are used; a gs://
    URL must name a bucket that exists and that these credentials may list, at an endpoint that
    answers within CHECK_DEADLINE_S. `what` names the setting in the message (e.g. "checkpoint.dir").
    `local_only` (the reason) refuses URLs; `read_only` lets other URLs fsspec reads through (https://)."""
    location = str(location)
    if not is_remote(location):
        return
    if local_only:
        raise StorageError(f"{what}: {location}: must be a local path ({local_only})")
    if not location.startswith(GS):
        if read_only:
            return
        scheme = location.split("://", 1)[0]
        raise StorageError(f"{what}: {location}: {scheme}:// is not supported (a local path or gs://BUCKET/PATH)")
    try:
        bucket, prefix = split_gs(location)
    except StorageError as e:
        raise StorageError(f"{what}: {e}") from None
    from google.api_core import exceptions
    from google.api_core.retry import Retry

    client = _client()
    try:
        list(client.list_blobs(bucket, prefix=prefix or None, max_results=1, timeout=CHECK_DEADLINE_S / 2,
                               retry=Retry(timeout=CHECK_DEADLINE_S, initial=0.5, maximum=4.0)))
    except exceptions.NotFound:
        raise StorageError(f"{what}: {location}: bucket {bucket} does not exist (credentials: "
                           f"{describe_credentials()})") from None
    except exceptions.Forbidden as e:
        raise StorageError(f"{what}: {location}: no permission to list bucket {bucket} ({_http_message(e)}; "
                           f"credentials: {describe_credentials()})") from None
    except exceptions.GoogleAPICallError as e:
        raise StorageError(f"{what}: {location}: the storage endpoint refused it ({_http_message(e)})") from None
    except Exception as e:  # RetryError, a connection refused, a DNS failure: the endpoint does not answer
        raise StorageError(f"{what}: {location}: cannot reach the storage endpoint {endpoint()} within "
                           f"{CHECK_DEADLINE_S:.0f} s ({_network_cause(e)})") from None


def endpoint() -> str:
    return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"


def describe_credentials() -> str:
    """Which credentials gs:// is reached with, in a few words."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return f"none, the storage emulator at {os.environ['STORAGE_EMULATOR_HOST']}"
    credentials, _ = _default_credentials()
    if credentials is None:
        return "none found, anonymous access"
    who = getattr(credentials, "service_account_email", None) or getattr(credentials, "signer_email", None)
    return f"application default credentials{f' ({who})' if who and who != 'default' else ''}"


def _network_cause(error: BaseException) -> str:
    """'[Errno 111] Connection refused' out of the layers of a retried request's error."""
    text = str(getattr(error, "cause", None) or error)
    found = re.search(r"\[Errno -?\d+\] [^'\")\]]+|Name or service not known|timed out", text)
    return found.group(0).strip() if found else first_line(text)


def credentials_note() -> str | None:
    """One line for the run's header when gs:// is reached without credentials, else None."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return f"storage: gs:// goes to the emulator at {os.environ['STORAGE_EMULATOR_HOST']} (STORAGE_EMULATOR_HOST)"
    if _default_credentials()[0] is None:
        return ("storage: no Google Cloud credentials found (a VM's service account, GOOGLE_APPLICATION_CREDENTIALS "
                "or `gcloud auth application-default login`): gs:// is read anonymously, public buckets only")
    return None


@functools.cache
def _default_credentials():
    import google.auth
    import google.auth.exceptions

    try:
        return google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    except google.auth.exceptions.DefaultCredentialsError:
        return None, None


def _client():
    """The google-cloud-storage client (anonymous against an emulator or without credentials)."""
    return _client_for(os.environ.get("STORAGE_EMULATOR_HOST"))


@functools.cache
def _client_for(emulator: str | None):
    from google.cloud import storage

    if emulator:
        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "zerolm"))
    credentials, project = _default_credentials()
    if credentials is None:
        return storage.Client.create_anonymous_client()
    return storage.Client(credentials=credentials, project=project or os.environ.get("GOOGLE_CLOUD_PROJECT"))


# TensorStore (orbax's client for checkpoint arrays) logs one line to stderr, from C++ and whatever the log
# settings, the first time a process reaches GCS: where it found credentials, or, where it found no file and no
# metadata server (an emulator, or a machine with none), an error saying so, although an emulator wants none and
# zerolm says it in its own words (credentials_note, describe_credentials). Nothing else of it is held back.
_TENSORSTORE_CREDENTIALS_LINE = re.compile(r"^[IWE]\d{4} [\d:. ]+\d+ google_auth_provider\.cc:\d+\] ")


@functools.cache
def quiet_tensorstore_credentials(location: str) -> None:
    """Have TensorStore look for its credentials now, for a gs:// location orbax is about to use, with that
    one line left out of stderr (the file descriptor its C++ log writes to; any other line written meanwhile,
    by any thread, is written after). What fails here fails again, and is reported, where orbax reads or
    writes the checkpoint."""
    import tempfile

    import tensorstore as ts

    bucket, _ = split_gs(location)
    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result().read(".zerolm-credentials").result()
        except ValueError:  # TensorStore's error for a request that failed: orbax's own will say it
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        lines = caught.read().decode(errors="replace").splitlines(keepends=True)
    sys.stderr.write("".join(line for line in lines if not _TENSORSTORE_CREDENTIALS_LINE.match(line)))


def _http_message(error) -> str:
    return f"HTTP {getattr(error, 'code', '?')}: {first_line(getattr(error, 'message', error))}"


# --- files --------------------------------------------------------------------------------------------


def write_atomic(target: epath.Path, data: bytes | str) -> None:
    """Write a file that readers see whole or not at all: one object on gs://, a renamed sibling locally."""
    data = data.encode() if isinstance(data, str) else data
    if is_remote(target):
        target.write_bytes(data)
        return
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    tmp.write_bytes(data)
    os.replace(tmp, target)


def create_once(target: epath.Path, data: bytes | str) -> bytes:
    """Write a file only if there is none; the file's content afterwards: `data`, or what another writer
    put there first (GCS: a write that requires generation 0; locally O_EXCL)."""
    data = data.encode() if isinstance(data, str) else data
    if is_remote(target):
        versioned = Versioned(str(target))
        if versioned.write(data, 0) is None:
            found = versioned.read()
            assert found is not None, target  # another writer created it; nothing here deletes it
            return found[0]
        return data
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    tmp.write_bytes(data)
    try:
        os.link(tmp, target)  # atomic and exclusive: readers never see a partial file
    except FileExistsError:
        return target.read_bytes()
    finally:
        tmp.unlink()
    return data


def sizes(directory: epath.Path) -> dict[str, int]:
    """Every file under `directory`, by path relative to it, with its size: one listing on gs://."""
    if is_remote(directory):
        fs, root = _fs(directory)
        found = fs.find(root, detail=True, withdirs=False)
        return {name[len(root):].lstrip("/"): int(info["size"]) for name, info in found.items()
                if info.get("type") != "directory" and not name.endswith("/")}
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            full = Path(dirpath) / name
            out[str(full.relative_to(directory))] = full.stat().st_size
    return out


def remove_tree(target: epath.Path) -> None:
    """Delete a directory and everything under it, or a file (on gs://: every object under the prefix)."""
    if is_remote(target):
        fs, root = _fs(target)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(root, recursive=True)
    elif Path(target).is_file():
        Path(target).unlink(missing_ok=True)
    else:
        shutil.rmtree(target, ignore_errors=True)


def move(source: epath.Path, target: epath.Path) -> None:
    """Move a file or directory: a rename locally; on gs://, a server-side copy of every object, then
    the source's deletion (readers may see both for a moment, never neither)."""
    if not is_remote(source):
        os.replace(source, target)
        return
    fs, src = _fs(source)
    _, dst = _fs(target)
    directory = fs.isdir(src)
    fs.copy(src, dst, recursive=directory)
    fs.rm(src, recursive=directory)


def read_bytes(url: str) -> bytes:
    """A whole remote file (FileNotFoundError if there is none)."""
    fs, name = _fs(url)
    return fs.cat_file(name)


def read_ranges_of(urls: list[str], ranges: list[tuple[int, int]]) -> list[bytes]:
    """Byte ranges [start, end) of remote files (urls[i] holds ranges[i]; one filesystem, one file or many),
    fetched concurrently."""
    fs, _ = _fs(urls[0])
    names = [_fs(url)[1] for url in urls]
    return fs.cat_ranges(names, [a for a, _ in ranges], [b for _, b in ranges], on_error="raise")


def size(url: str) -> int:
    fs, name = _fs(url)
    return int(fs.info(name)["size"])


def glob(pattern: str) -> list[str]:
    """The files (not directories) a remote URL pattern matches, as URLs, sorted."""
    fs, name = _fs(pattern)
    scheme = str(pattern).split("://", 1)[0]
    with faults(pattern, "listing"):
        return sorted(f"{scheme}://{p}" for p, info in fs.glob(name, detail=True).items() if info["type"] == "file")


def _fs(location) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a URL, and the path it takes (no scheme, no trailing slash)."""
    fs, name = fsspec.core.url_to_fs(str(location))
    return fs, name.rstrip("/")


@contextlib.contextmanager
def faults(location: str | os.PathLike, doing: str) -> Iterator[None]:
    """Turn a client's failure at `location` into a StorageFault with one line (what, where, why)."""
    try:
        yield
    except (StorageError, StorageFault, FileNotFoundError):  # a missing file is the caller's to explain
        raise
    except Exception as e:  # gcsfs, aiohttp, google-api-core and TensorStore each raise their own
        raise StorageFault(f"{location}: {doing} failed ({type(e).__name__}: {first_line(e)})") from None


# --- versioned objects (the lease) ------------------------------------------------------------------


class Versioned:
    """One gs:// object, written only if it is still the version last seen (GCS generations): two
    writers that both saw version g cannot both replace it; exactly one `create` of a missing object
    wins. Calls retry transient faults for up to `deadline_s`, then raise StorageFault."""

    def __init__(self, url: str, deadline_s: float = 30.0):
        bucket, self.name = split_gs(url)
        self.url, self.deadline_s = url, deadline_s
        self.bucket = _client().bucket(bucket)

    def _retry(self):
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import DEFAULT_RETRY

        return Retry(predicate=DEFAULT_RETRY._predicate, timeout=self.deadline_s, initial=0.5, maximum=8.0)

    def read(self) -> tuple[bytes, int] | None:
        """The content and its generation, or None if there is no such object."""
        from google.api_core import exceptions

        with faults(self.url, "reading"):
            try:
                blob = self.bucket.get_blob(self.name, retry=self._retry(), timeout=self.deadline_s)
                if blob is None:
                    return None
                return blob.download_as_bytes(if_generation_match=blob.generation, retry=self._retry(),
                                              timeout=self.deadline_s), int(blob.generation)
            except (exceptions.NotFound, exceptions.PreconditionFailed):  # deleted or replaced meanwhile
                return self.read()

    def write(self, data: bytes, generation: int) -> int | None:
        """Write `data` if the object is still at `generation` (0: if it does not exist); its new
        generation, or None if another writer came first."""
        from google.api_core import exceptions

        blob = self.bucket.blob(self.name)
        with faults(self.url, "writing"):
            try:
                blob.upload_from_string(data, if_generation_match=generation, retry=self._retry(),
                                        timeout=self.deadline_s)
                return int(blob.generation)
            except exceptions.PreconditionFailed:
                # Also what a retried write sees when its first attempt succeeded but the answer was lost.
                now = self.read()
                return now[1] if now is not None and now[0] == data else None

    def delete(self, generation: int) -> bool:
        """Delete the object if it is still at `generation`."""
        from google.api_core import exceptions

        with faults(self.url, "deleting"):
            try:
                self.bucket.blob(self.name).delete(if_generation_match=generation, retry=self._retry(),
                                                   timeout=self.deadline_s)
                return True
            except (exceptions.PreconditionFailed, exceptions.NotFound):
                return False


def cache_dir() -> Path:
    """Where zerolm keeps what it builds and may build again (tokenizers, the prepared default data, compiled
    programs): $ZEROLM_CACHE, or ~/.cache/zerolm."""
    return Path(os.environ.get("ZEROLM_CACHE", Path.home() / ".cache" / "zerolm"))
