"""A sweep's Optuna study: its storage, what it was made with, its trials' budget, and continuing interrupted trials.

The study lives in a database: an SQLite file in the sweep's folder by
default, or a server (``--storage postgresql://...``) that several workers
share. Everything a worker needs to decide is read from there, so a sweep
killed and started again, or joined by another worker, continues where the
study stands:

* **What it was made with.** The first worker records the space and the
  run's config (``output`` and ``logging`` aside) on the study; a worker with
  another space or config is refused before any trial starts.
* **The budget.** ``trials`` counts the trials the sampler drew, in the
  order the storage numbered them; a drawn trial numbered past the budget
  (several workers asked at once) ends at once without running, marked so,
  so exactly ``trials`` run whatever the number of workers.
* **Continuing.** A trial stopped by SIGTERM / SIGINT leaves its checkpoint
  and is continued by a new trial with the same values in the same folder
  (Optuna's pattern for retried trials): the run resumes from its checkpoint,
  not from the start. A worker killed without a word (SIGKILL, a lost
  machine) stops its trial's heartbeat; once the heartbeat is stale, the next
  worker to start a trial fails it and queues its continuation the same way.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from finetune.errors import ConfigError

logger = logging.getLogger("finetune")

# trial user attributes
FOLDER = "folder"              # the trial's folder, relative to the sweep's
CONTINUES = "continues"        # number of the interrupted trial this one continues
INTERRUPTED = "interrupted"    # why the trial stopped before its end (then continued by another)
BEYOND_BUDGET = "beyond_budget"
SAME_AS = "same_as"            # a finished trial with the same values: its result is this one's
FAILED = "failed"              # why the trial failed (a non-finite loss, an input error)
PRUNED = "pruned"              # why the pruner stopped the trial
STOPPED_SWEEP = "stopped_sweep"  # an input error in this trial stopped the sweep
EVAL_LOSS = "eval_loss"        # the validation loss of the trial's saved model (its seeds' mean): decides ties
# study user attributes
SPACE_ATTR, CONFIG_ATTR, BASE_PARAMS_ATTR = "finetune.space", "finetune.config", "finetune.base_params"
FEW_UPDATES_ATTR = "finetune.few_updates"  # a trial's start line cautioned of few updates: the reports sum them up

# Seconds between a running trial's heartbeats, and without one before the trial counts as lost.
HEARTBEAT_S, GRACE_S = 30, 120
# tries at opening a database another worker may be creating
ATTEMPTS = 4


def open_storage(url: str):
    """Optuna's database storage at ``url``, with heartbeats so that a lost worker's trial is continued.

    Raises:
        ConfigError: ``--storage`` named, when the URL is malformed, its driver is
            missing or the database cannot be reached.
    """
    import optuna
    import sqlalchemy.exc

    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    # the callback's name changed in Optuna 4.9; take the one this Optuna has
    parameters = inspect.signature(optuna.storages.RDBStorage).parameters
    callback = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in parameters
                else "failed_trial_callback")
    with storage_errors(url):
        for attempt in range(ATTEMPTS):
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S,
                                                  grace_period=GRACE_S, **{callback: queue_continuation})
            except sqlalchemy.exc.DBAPIError as exc:
                if attempt == ATTEMPTS - 1 or not _lost_the_race_to_create(exc):
                    raise
                time.sleep(1.0 + attempt)


def existing_storage(url: str):
    """What a dry run reads of ``--storage``, writing nothing: the URL and its driver checked, a server's answer
    (a connection opened and closed), and the storage opened to be read where Optuna's tables are in it already;
    else ``None`` (a SQLite file not made yet, which connecting would make; a database without the tables).

    Raises:
        ConfigError: as :func:`open_storage` does.
    """
    import optuna
    import sqlalchemy

    with storage_errors(url):
        engine = sqlalchemy.create_engine(url)  # the URL and its driver; it connects to nothing yet
        try:
            if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
                return None
            tables = set(sqlalchemy.inspect(engine).get_table_names())
        finally:
            engine.dispose()
        # Optuna writes its version records where these tables lack them: with them it only reads
        if not {"studies", "version_info", "alembic_version"} <= tables:
            return None
        return optuna.storages.RDBStorage(url, skip_table_creation=True)


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """A storage that cannot be opened, said in one line naming ``--storage`` (its password left out)."""
    import sqlalchemy.exc

    try:
        yield
    except ImportError as exc:  # the driver's ModuleNotFoundError, or Optuna's ImportError raised from it
        name = getattr(exc.__cause__, "name", None) or exc.name or "module"
        driver = {"psycopg": "pip install 'psycopg[binary]'", "psycopg2": "pip install psycopg2-binary",
                  "pymysql": "pip install pymysql"}.get(name, "")
        raise ConfigError(f"--storage {redact(url)}: its database driver {name} is not installed"
                          + (f" ({driver})" if driver else "")) from None
    except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise ConfigError(f"--storage {redact(url)}: cannot open the study's database: {first}") from None
    except RuntimeError as exc:  # Optuna's word for tables of an older schema: a sweep begun before an upgrade
        if "table schema" not in str(exc):
            raise
        import optuna

        raise ConfigError(f"--storage {redact(url)}: the study's tables have an older schema than this Optuna's "
                          f"({optuna.__version__})",
                          hint=f"optuna storage upgrade --storage {redact(url)} brings them up to date") from None


def _lost_the_race_to_create(exc) -> bool:
    """Whether ``exc`` is what a worker meets when another one, starting at the same moment, creates the study's
    tables first (a lock it waited on, a duplicate key, or PostgreSQL's "relation already exists"); the tables are
    there on its next try. A server not up yet answers as a lock does, and is given the same tries."""
    import sqlalchemy.exc

    if isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError)):
        return True
    return isinstance(exc, sqlalchemy.exc.ProgrammingError) and "already exists" in str(exc.orig)


def refuse_a_database_in_memory(url: str) -> None:
    """Refuse an SQLite URL without a file (``sqlite://``, ``sqlite:///:memory:``): its study would be gone with
    the process, so no second worker would share it and no second run continue it.

    Raises:
        ConfigError: naming ``--storage``.
    """
    head, _, path = url.partition("://")
    if head.split("+")[0] == "sqlite" and path.lstrip("/").split("?")[0] in ("", ":memory:"):
        raise ConfigError(f"--storage {url}: a database in memory, which no other worker shares and no later run "
                          f"continues; name a file (sqlite:///sweep/study.db)")


def redact(url: str) -> str:
    """A storage URL without its password, for messages and the start line."""
    head, sep, tail = url.partition("://")
    if "@" in tail and ":" in tail.split("@", 1)[0]:
        user = tail.split("@", 1)[0].split(":", 1)[0]
        tail = f"{user}:***@{tail.split('@', 1)[1]}"
    return f"{head}{sep}{tail}"


def refuse_another_sweep(storage, name: str, made_with: dict[str, str], searches: bool,
                         repeated: Optional[str] = None) -> None:
    """A sweep's folder (its study name) holds one sweep: another one there is refused before any trial, since
    its reports would replace the first one's.

    A sweep without a space (seeds or folds only) meets the search of an earlier sweep, or any sweep meets seeds
    or folds runs made with another space or config, or folds runs meet seeds runs (``repeated``: which this
    sweep makes): all are refused, naming what to do. A search made with another space or config is
    :func:`load_or_create`'s to refuse.

    Raises:
        ConfigError: naming the study and what differs.
    """
    import optuna

    existing = set(optuna.get_all_study_names(storage))
    if name in existing and not searches:
        raise ConfigError(f"--study-name {name}: the study holds a search, and this sweep has no space, so its "
                          f"report would replace the search's; run the search's command again (--seeds N or "
                          f"--folds K adds those runs to it), or choose another --output or --study-name")
    for other in ("seeds", "folds"):
        if f"{name}.{other}" not in existing:
            continue
        if repeated is not None and other != repeated:
            raise ConfigError(f"--study-name {name}: the study holds {other} runs, and this sweep runs {repeated}, "
                              f"whose report would replace theirs; choose another --output or --study-name")
        _check_made_with(optuna.load_study(study_name=f"{name}.{other}", storage=storage), name, made_with)


def load_or_create(storage, name: str, direction: str, made_with: dict[str, str]):
    """The study ``name`` in ``storage``, created if new; one made with another space or config is refused.

    Args:
        made_with: ``{SPACE_ATTR: ..., CONFIG_ATTR: ...}``, canonical JSON.

    Raises:
        ConfigError: naming what differs, before any trial starts.
    """
    import optuna

    study = optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True)
    check_study(study, name, direction, made_with)
    for attr, text in made_with.items():
        if study.user_attrs.get(attr) is None:
            study.set_user_attr(attr, text)
    return study


def check_study(study, name: str, direction: str, made_with: dict[str, str]) -> None:
    """Refuse a study that optimizes the other way, or was made with another space or config."""
    if study.direction.name.lower() != direction:
        raise ConfigError(f"--study-name {name}: this study {study.direction.name.lower()}s its objective, this "
                          f"sweep would {direction} it (another evaluation.metric_for_best_model or "
                          f"greater_is_better); choose another --output or --study-name")
    _check_made_with(study, name, made_with)


def made_with(space, cfg) -> dict[str, str]:
    """A study's identity: the space, and the run's config without where it writes and what it logs."""
    config = {k: v for k, v in cfg.to_dict().items() if k not in ("output", "logging")}
    return {SPACE_ATTR: space.identity(), CONFIG_ATTR: json.dumps(config, sort_keys=True, default=str)}


def _check_made_with(study, name: str, made_with: dict[str, str]) -> None:
    """Refuse a study whose recorded space or config is not ``made_with``'s (one not yet recorded passes)."""
    for attr, text in made_with.items():
        recorded = study.user_attrs.get(attr)
        if recorded is not None and recorded != text:
            raise ConfigError(f"--study-name {name}: the study was made with another "
                              f"{'space' if attr == SPACE_ATTR else 'config'} ({first_difference(recorded, text)}); "
                              f"run the same files again to continue it, or choose another --output or --study-name")


def first_difference(recorded: str, current: str) -> str:
    """The first key whose value differs between two canonical JSON mappings, said both ways."""
    old, new = json.loads(recorded), json.loads(current)
    flat_old, flat_new = _flatten(old), _flatten(new)
    for key in sorted(set(flat_old) | set(flat_new)):
        if flat_old.get(key, "absent") != flat_new.get(key, "absent"):
            return f"{key}: {json.dumps(flat_old.get(key, 'absent'))} there, {json.dumps(flat_new.get(key, 'absent'))} here"
    return "the same keys, in another order"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def counts_against_budget(trial) -> bool:
    """A trial the sampler drew (not a continuation) that ran or runs: what ``trials`` counts."""
    attrs = trial.user_attrs
    return CONTINUES not in attrs and not attrs.get(BEYOND_BUDGET) and not attrs.get(STOPPED_SWEEP)


def drawn_before(study, number: int) -> int:
    """How many trials numbered below ``number`` count against the budget."""
    return sum(1 for t in study.get_trials(deepcopy=False) if t.number < number and counts_against_budget(t))


def trials_done(study) -> int:
    """Trials that ended for good: finished, but not interrupted (its continuation is the same trial, counted
    when it ends), drawn past the budget, or stopped by an input error (neither ran)."""
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished() and not (
        t.user_attrs.get(INTERRUPTED) or t.user_attrs.get(BEYOND_BUDGET) or t.user_attrs.get(STOPPED_SWEEP)))


def budget_left(study, trials: int) -> int:
    """Trials still to run for a budget of ``trials``: those queued, and those the sampler has yet to draw."""
    from optuna.trial import TrialState

    every = study.get_trials(deepcopy=False)
    queued = sum(1 for t in every if t.state == TrialState.WAITING)
    return queued + max(trials - sum(1 for t in every if counts_against_budget(t)), 0)


def running(study) -> int:
    """Trials running now (here or in another worker)."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def queue_continuation(study, trial) -> None:
    """Queue a trial with ``trial``'s values that continues it in its folder (it resumes from its checkpoint).

    Also Optuna's callback for a trial whose worker was lost (its heartbeat went stale). Made as Optuna's own
    retry callback makes a retried trial: a waiting trial with the values set and the system attributes copied,
    among them the grid sampler's point, so that the grid counts the continuation as that point's.
    """
    import optuna

    # a running trial's own object has no system attributes: its record in the study has
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        user_attrs={FOLDER: trial.user_attrs.get(FOLDER), CONTINUES: trial.number},
        system_attrs=dict(trial.system_attrs)))
    logger.warning("trial %d (%s) stopped before its end; queued to continue from its checkpoint", trial.number,
                   trial.user_attrs.get(FOLDER))


def finished_same(study, params: dict[str, Any], number: int) -> Optional[Any]:
    """A completed trial with exactly these values (and a result), other than ``number``; else ``None``."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if trial.number != number and trial.params == params and trial.value is not None:
            return trial
    return None
