"""Whether the Hugging Face Hub can be reached, asked once, before a model or data set is looked up there.

Unreachable, the Hub costs every file that transformers and datasets look up
their own retries: about a minute for a model, half a minute for a data set,
and a warning line per retry, before either reads its local cache. Compute
nodes without network meet this on every run. One request with no retries
(:func:`unreachable`) says so at once; a model and its tokenizer are then read
from the local cache only (``local_files_only``, a public argument of every
``from_pretrained``), and a data set from datasets' cache only
(:func:`datasets_cache_only`). Nothing is asked of the Hub where
``HF_HUB_OFFLINE`` is set: the user has said so already.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Iterator, Optional

from finetune.errors import is_main_rank

logger = logging.getLogger("finetune")

# seconds the one request may take; huggingface_hub's own wait for a file's metadata is 10 s as well
TIMEOUT_S = 10.0


@functools.lru_cache(maxsize=None)
def unreachable(repo_id: str, repo_type: str = "model") -> Optional[str]:
    """Why the Hub gave no answer about ``repo_id`` just now (the transport's error, in one line), or ``None``:
    it answered (an answer that refuses, a repository not found or gated, counts: the Hub is there, and the
    loaders' own errors say what it refused), offline mode is on, or the id is not one the Hub could hold."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return None
    api = HfApi()
    info = api.dataset_info if repo_type == "dataset" else api.model_info
    try:
        info(repo_id, timeout=TIMEOUT_S)
    except (HfHubHTTPError, ValueError):  # an HTTP answer, or an id the Hub would refuse (the loaders say so)
        return None
    except Exception as exc:  # noqa: BLE001 - no answer at all, whatever the HTTP library calls it
        lines = str(exc).strip().splitlines()
        return lines[0] if lines else type(exc).__name__
    return None


def is_local(location: str) -> bool:
    """Whether ``location`` is a path on this machine (what ``from_pretrained`` reads without the Hub)."""
    return Path(location).expanduser().exists()


def model_options(location: str, weights: bool = False) -> dict:
    """``from_pretrained``'s keyword arguments for ``location``: ``local_files_only`` where it is a Hub id and the
    Hub cannot be reached (said once per id), else none. ``weights``: for a model class's ``from_pretrained``,
    whose look-up of a PEFT adapter takes only its own ``adapter_kwargs`` in transformers 5, so these go there
    too (transformers 4 hands that look-up ``local_files_only`` itself, and a second one there is a TypeError)."""
    if is_local(location):
        return {}
    why = unreachable(location)
    if why is None:
        return {}
    major = transformers_major()
    # transformers 4's Auto classes look for a PEFT adapter of the id with arguments of their own, which cannot
    # say "cache only" (a second local_files_only there is a TypeError); a cache filled by from_pretrained notes
    # the adapter's absence and answers, one filled by `hf download` does not: the user is told what that costs
    retries = ("; transformers 4 may still ask it for an adapter of the model (a cache filled by `hf download`): "
               "half a minute of retries that HF_HUB_OFFLINE=1 skips" if major < 5 else "")
    say_once(f"the Hugging Face Hub cannot be reached ({why}): {location} is read from the local cache only "
             f"(HF_HUB_OFFLINE=1 skips this check){retries}")
    adapter = weights and major >= 5
    return {"local_files_only": True, **({"adapter_kwargs": {"local_files_only": True}} if adapter else {})}


def transformers_major() -> int:
    """The installed transformers' major version: where the package meets transformers 4 and 5 differently (this
    module's adapter look-up, a whole compile's mask building, the CPU's attention)."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def offline_reason(location: str) -> Optional[str]:
    """For an error's message: why ``location`` was looked up in the local cache only (``None``: it was not)."""
    return None if is_local(location) else unreachable(location)


@contextlib.contextmanager
def datasets_cache_only(shown: str, why: Optional[str]) -> Iterator[None]:
    """Where the Hub could not be reached (``why``, from :func:`unreachable`; ``None``: it could, and nothing
    changes), ``datasets.load_dataset`` reads its local cache within it without asking the Hub, said once.

    datasets has no argument for that: its offline switch, ``datasets.config.HF_HUB_OFFLINE``, is read from the
    environment at import and looked up at each call, so it is set for the call's length. A datasets release
    without that attribute asks the Hub as it always did, and the warning says what that costs.
    """
    import datasets.config

    if why is None:
        yield
        return
    if not hasattr(datasets.config, "HF_HUB_OFFLINE"):
        say_once(f"the Hugging Face Hub cannot be reached ({why}): datasets retries for a while before it reads "
                 f"{shown} from its local cache; HF_HUB_OFFLINE=1 reads it at once")
        yield
        return
    say_once(f"the Hugging Face Hub cannot be reached ({why}): {shown} is read from datasets' local cache only "
             "(HF_HUB_OFFLINE=1 skips this check)")
    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


@functools.lru_cache(maxsize=None)
def say_once(message: str) -> None:
    """Log ``message`` as a warning once per process, and from a launch's first process only: every process
    asks the Hub, the first one speaks for them."""
    if is_main_rank():
        logger.warning(message)
