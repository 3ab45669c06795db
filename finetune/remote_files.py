"""A data file given as a URL (``https://``, ``hf://datasets/...``, or another protocol fsspec has installed):
downloaded into ``datasets``' download cache, then read as the local file it is.

``datasets``' downloader does the work: its cache (``HF_DATASETS_CACHE``), a file downloaded once and checked
against the server's ETag after, and ``hf://`` and fsspec's protocols. It names a cached file by a hash of the
URL and the ETag, which drops the extension that the format and the compression are read from; so a link in
``downloads/named/`` carries the URL's file name, and every reader and check after this sees a plain local file
named as the URL names it. The link is also what is read where the URL cannot be reached, which the
downloader's own cache does not serve.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
import urllib.parse
from pathlib import Path
from typing import Optional

from finetune.errors import DataError, innermost, root_message

logger = logging.getLogger("finetune.data")

_URL = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)
# the URLs whose copy this process has named in the log: a run reads its data file more than once
_SAID: set[str] = set()


def is_url(spec: str) -> bool:
    """Whether a data file's setting is a URL (``scheme://...``) rather than a path."""
    return _URL.match(str(spec)) is not None


def url_file_name(url: str) -> str:
    """The file a URL names, without its query: ``reviews.csv`` for ``https://host/d/reviews.csv?raw=1``."""
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1])


def local_copy(url: str, key: str) -> Path:
    """The downloaded copy of the file at ``url``, named as the URL names it.

    Each call asks the server for the file's ETag (a request without the file): a kernel that sets up a run
    again reads a file that changed since. Where the URL cannot be reached (no network, offline mode) and an
    earlier run downloaded it, that copy is read, with a warning that it may be out of date.

    Raises:
        DataError: naming ``key`` and the URL where it cannot be downloaded.
    """
    import datasets

    name = url_file_name(url)
    if not name:
        raise DataError(f"{key}: {url} names no file (a URL of a data file ends with its name: .../reviews.csv)")
    # the link's place depends on the URL alone, so that it is found again where the URL cannot be reached
    named = Path(datasets.config.DOWNLOADED_DATASETS_PATH) / "named" / _digest(url) / name
    try:
        cached = Path(datasets.DownloadManager().download(url))
    except Exception as exc:  # noqa: BLE001 - HTTP, fsspec and offline mode each fail in their own type
        # datasets' cache answers only after asking the server (for its ETag): offline, it serves nothing
        unreachable = isinstance(innermost(exc), OSError)  # refused, unresolved, timed out, offline mode
        if unreachable and named.exists():
            logger.warning("%s cannot be reached (%s): reading the copy downloaded on %s, which may be out of date",
                           url, root_message(exc), time.strftime("%Y-%m-%d", time.localtime(named.stat().st_mtime)))
            return named
        raise DataError(f"{key}: cannot download {url}: {root_message(exc)}", hint=_download_hint(url, exc)) from None
    _refuse_a_web_page(cached, url, key)
    if not named.exists() or named.resolve() != cached.resolve():
        _link(named, cached)
    if url not in _SAID:
        _SAID.add(url)
        logger.info("%s: read from its downloaded copy, %s", url, named)
    return named


def _refuse_a_web_page(cached: Path, url: str, key: str) -> None:
    """Stop where the server sent a web page for the file: a code host's page that shows a file (GitHub's
    ``/blob/``) is an HTML page, and its reader would take the page's markup for rows."""
    with open(cached, "rb") as fh:
        start = fh.read(512).lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if not start.startswith((b"<!doctype html", b"<html")):
        return
    raw = _raw_url(url)
    raise DataError(f"{key}: {url} is a web page (HTML), not the data file",
                    hint=f"the file itself is at {raw}" if raw else "give the URL of the file itself (a 'raw' or "
                    "'download' link)")


def _raw_url(url: str) -> Optional[str]:
    """The URL of the file itself for a page that shows it: GitHub's and the Hub's ``/blob/``, a Dropbox
    shared link's preview (``dl=0``)."""
    github = re.match(r"https?://github\.com/([^/]+/[^/]+)/blob/(.+)", url)
    if github:
        return f"https://raw.githubusercontent.com/{github.group(1)}/{github.group(2)}"
    hub = re.match(r"(https?://huggingface\.co/(?:datasets/)?[^/]+/[^/]+)/blob/(.+)", url)
    if hub:
        return f"{hub.group(1)}/resolve/{hub.group(2)}"
    if re.match(r"https?://(www\.)?dropbox\.com/", url) and "dl=0" in url:  # a shared link's preview page
        return url.replace("dl=0", "dl=1")
    return None


def _digest(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:32]


def _link(named: Path, cached: Path) -> None:
    """Point ``named`` at ``cached``; each process of a launch may do so at once, so the link is made aside
    and renamed into place."""
    named.parent.mkdir(parents=True, exist_ok=True)
    aside = named.with_name(f".{named.name}.{os.getpid()}")
    aside.unlink(missing_ok=True)
    try:
        aside.symlink_to(cached)
    except OSError:  # a file system without links: a copy, at the cost of the disk it takes
        shutil.copyfile(cached, aside)
    os.replace(aside, named)


def _download_hint(url: str, exc: Exception) -> Optional[str]:
    """What makes a failed download work: offline mode off, credentials, the package of the URL's protocol, or a
    Hub data set by its name."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    missing = innermost(exc)
    if isinstance(missing, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: unset it for the download, which later runs reuse"
    status = getattr(missing, "status", None) or getattr(getattr(missing, "response", None), "status_code", None)
    if status in (401, 403):  # a private or gated file
        return ("the server asks who you are: a Hub file reads once `hf auth login` (or HF_TOKEN) holds a token "
                "that may read it; elsewhere, give a link that needs none, or download it yourself")
    if isinstance(missing, ModuleNotFoundError) and missing.name:
        scheme = urllib.parse.urlsplit(url).scheme
        return f"fsspec reads {scheme}:// with the package {missing.name} (pip install {missing.name}), or copy the " \
               f"file here and pass it"
    hub = re.match(r"hf://datasets/([\w.-]+/[\w.-]+)", url)
    if hub:
        return f"a Hugging Face Hub data set by its splits is data.dataset_name={hub.group(1)}"
    return None
