"""A data set handed out packed (a Kaggle ``.zip``, a paper's ``.tar.gz``) read where it is packed: the archive,
or a path inside it, unpacked once into the cache and read as the file or folder it holds."""

from __future__ import annotations

import io
import logging
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from finetune.config import DataConfig
from finetune.data import load_splits
from finetune.errors import DataError, FileLayoutError
from finetune.local_files import read_local
from helpers import make_texts, serving, write_csv

ROWS = "text,label\n" + "".join(f"message {i},{'spam' if i % 3 == 0 else 'ham'}\n" for i in range(12))


def _cfg(train_file: str, **settings) -> DataConfig:
    return DataConfig(train_file=train_file, validation_split=0.0, **settings)


def _texts(spec: str) -> list[str]:
    return load_splits(_cfg(spec), seed=0)[0]["train"]["text"]


def _zip(path: Path, files: dict[str, str | bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as packed:
        for name, content in files.items():
            packed.writestr(name, content)
    return path


def _tar(path: Path, files: dict[str, str | bytes], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as packed:
        for name, content in files.items():
            data = content.encode("utf-8") if isinstance(content, str) else content
            member = tarfile.TarInfo(name)
            member.size = len(data)
            packed.addfile(member, io.BytesIO(data))
    return path


@pytest.mark.parametrize("name, mode", [("spam.zip", None), ("spam.tar", "w"), ("spam.tar.gz", "w:gz"),
                                        ("spam.tgz", "w:gz"), ("spam.tar.bz2", "w:bz2"), ("spam.tar.xz", "w:xz")])
def test_an_archive_of_one_data_file_trains_on_the_rows_of_that_file(downloads, tmp_path, name, mode):
    plain = write_csv(tmp_path / "spam.csv", make_texts(20, seed=3))
    content = plain.read_text(encoding="utf-8")
    packed = _zip(tmp_path / name, {"spam.csv": content}) if mode is None else \
        _tar(tmp_path / name, {"spam.csv": content}, mode)
    expected, expected_labels = load_splits(_cfg(str(plain)), seed=0)
    plain.unlink()  # nothing beside the archive is read
    splits, labels = load_splits(_cfg(str(packed)), seed=0)
    assert splits["train"].to_list() == expected["train"].to_list() and len(splits["train"]) == 20
    assert labels.names == expected_labels.names


def test_the_folders_that_wrap_an_archive_and_what_packers_add_are_looked_past(downloads, tmp_path, caplog):
    packed = _zip(tmp_path / "sms.zip", {"sms/spam.csv": ROWS, "sms/LICENSE.txt": "CC BY 4.0",
                                         "__MACOSX/sms/._spam.csv": b"\x00\x05\x16\x07", "sms/.DS_Store": b"\x00"})
    with caplog.at_level(logging.INFO, logger="finetune.data"):
        assert _texts(str(packed)) == [f"message {i}" for i in range(12)]
    assert f"{packed}: reading {packed}/sms/spam.csv, the one data file it holds" in caplog.messages


def test_a_run_on_an_archive_is_named_for_the_archive(tmp_path):
    from finetune.resources import data_name, file_name

    packed = _zip(tmp_path / "contest.zip", {"train.csv": ROWS})
    tarred = _tar(tmp_path / "aclImdb_v1.tar.gz", {"aclImdb/train/pos/0.txt": "good"})
    # the start line's name, and the output folder --data names: a competition's files are train.csv, test.csv
    assert (file_name(f"{packed}/train.csv"), data_name(f"{packed}/train.csv")) == ("contest.zip/train.csv", "contest")
    assert (file_name(str(packed)), data_name(str(packed))) == ("contest.zip", "contest")
    assert (file_name(f"{tarred}/aclImdb/train"), data_name(f"{tarred}/aclImdb/train")) == (
        "aclImdb_v1.tar.gz/aclImdb/train", "aclImdb_v1")
    assert data_name("https://host/d/reviews.tar.gz?raw=1") == "reviews"


def test_an_archive_of_several_data_files_is_told_to_name_one_and_reads_the_one_named(downloads, tmp_path):
    packed = _zip(tmp_path / "contest.zip", {"test.csv": ROWS, "train.csv": ROWS.replace("message", "train"),
                                             "sample_submission.csv": "id,label\n1,ham\n"})
    with pytest.raises(DataError) as info:
        load_splits(_cfg(str(packed)), seed=0)
    assert info.value.message == (f"data.train_file: {packed} holds 3 data files ({packed}/sample_submission.csv, "
                                  f"{packed}/test.csv, {packed}/train.csv): name one")
    assert info.value.hint == f"by its path in the archive: {packed}/train.csv"
    assert _texts(f"{packed}/train.csv") == [f"train {i}" for i in range(12)]  # as the hint says
    with pytest.raises(DataError, match=rf"^data\.train_file: {packed} holds no trian\.csv$") as info:
        load_splits(_cfg(f"{packed}/trian.csv"), seed=0)
    assert info.value.hint == f"did you mean {packed}/train.csv?"


def test_an_archive_without_a_data_files_extension_is_told_to_name_one_with_its_format(downloads, tmp_path):
    # the UCI repository's SMS Spam Collection: its data file has no extension
    lines = "".join(f"{label}\t{text}\n" for label, text in make_texts(20, seed=2))
    packed = _zip(tmp_path / "smsspamcollection.zip", {"README": "SMS Spam Collection v.1", "SMSSpamCollection": lines})
    with pytest.raises(DataError) as info:
        load_splits(_cfg(str(packed)), seed=0)
    assert info.value.message == (f"data.train_file: {packed} holds no file whose extension is a data format's "
                                  f"({packed}/README, {packed}/SMSSpamCollection)")
    assert info.value.hint == (f"name one by its path in the archive ({packed}/SMSSpamCollection) and its format "
                               f"with data.format")
    cfg = DataConfig(train_file=f"{packed}/SMSSpamCollection", format="tsv", has_header=False,
                     column_names=["label", "text"], validation_split=0.0)
    assert load_splits(cfg, seed=0)[0]["train"]["text"] == [text for _, text in make_texts(20, seed=2)]


def test_an_archive_of_class_folders_reads_each_folder_as_a_class(downloads, tmp_path):
    files = {f"bbc/{topic}/{i:03}.txt": f"{topic} story {i}" for topic in ("sport", "tech") for i in range(4)}
    packed = _tar(tmp_path / "bbc-fulltext.tar.gz", {**files, "bbc/README.TXT": "Five topics, 2225 articles"})
    splits, labels = load_splits(_cfg(str(packed)), seed=0)
    assert labels.names == ["sport", "tech"]
    assert sorted(splits["train"]["text"]) == sorted(files.values())
    # a folder inside it, named by its path
    splits, labels = load_splits(_cfg(f"{packed}/bbc"), seed=0)
    assert labels.names == ["sport", "tech"] and len(splits["train"]) == 8


def test_an_archive_of_splits_datasets_saved_validates_on_its_own_split_and_says_so(downloads, tmp_path):
    import datasets

    from finetune.data_sources import data_sources

    rows = make_texts(30, seed=1)
    splits = {name: datasets.Dataset.from_dict({"text": [t for _, t in part], "label": [l for l, _ in part]})
              for name, part in (("train", rows[:20]), ("validation", rows[20:]))}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved" / "sms"))
    packed = tmp_path / "sms.zip"
    with zipfile.ZipFile(packed, "w") as archive:
        for path in (tmp_path / "saved").rglob("*"):
            archive.write(path, path.relative_to(tmp_path / "saved").as_posix())
    cfg = DataConfig(train_file=str(packed))
    loaded, _ = load_splits(cfg, seed=0)
    assert (len(loaded["train"]), len(loaded["validation"])) == (20, 10)
    assert data_sources(cfg, seed=42).validation == "sms.zip validation split"  # not "10% ... held out"


def test_the_data_log_names_an_archives_files_by_their_path_in_it(downloads, tmp_path, caplog):
    files = {f"reviews/{label}/{i}.txt": f"{label} review {i}" for label in ("pos", "neg", "unsup") for i in range(3)}
    packed = _tar(tmp_path / "reviews.tar.gz", files)
    with caplog.at_level(logging.INFO, logger="finetune.data"):
        load_splits(_cfg(str(packed)), seed=0)
    unsup = next(message for message in caplog.messages if "'unsup'" in message)
    assert unsup.startswith(f"{packed}/reviews: the class folder 'unsup' is named as texts without a label")
    assert str(tmp_path / "downloads") not in unsup
    # as the warning says: left out, inside the archive, and said by its path there
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        loaded, labels = load_splits(_cfg(str(packed), drop_labels=["unsup"]), seed=0)
    assert labels.names == ["neg", "pos"] and len(loaded["train"]) == 6
    assert [m for m in caplog.messages if "unsup" in m] == [
        f"{packed}/reviews: left out 3 of 9 files, labelled unsup (data.drop_labels)"]


def test_imdb_as_downloaded_is_told_the_one_command_that_trains_it(downloads, tmp_path):
    """aclImdb_v1.tar.gz: splits, not classes, and an unlabelled folder in train; the hint, in the archive's
    paths, trains it as it stands."""
    files = {f"aclImdb/{split}/{label}/{i}_7.txt": f"{label} review {i}" for split, labels in
             (("train", ("pos", "neg", "unsup")), ("test", ("pos", "neg"))) for label in labels for i in range(3)}
    files.update({"aclImdb/README": "the data set", "aclImdb/train/urls_pos.txt": "http://example.com/1"})
    packed = _tar(tmp_path / "aclImdb_v1.tar.gz", files)
    with pytest.raises(DataError) as info:
        load_splits(_cfg(str(packed)), seed=0)
    root = f"{packed}/aclImdb"
    assert info.value.message == f"{root}: its sub-folders are splits (test, train), not classes"
    assert info.value.hint == (f"pass the training split's folder: --data {root}/train data.validation_file="
                               f"{root}/test data.drop_labels=[unsup] (the texts of {root}/train/unsup have no label)")
    loaded, labels = load_splits(_cfg(f"{root}/train", validation_file=f"{root}/test", drop_labels=["unsup"]), seed=0)
    assert labels.names == ["neg", "pos"] and (len(loaded["train"]), len(loaded["validation"])) == (6, 6)


def test_an_error_in_an_archives_file_names_it_by_its_path_in_the_archive(downloads, tmp_path):
    packed = _zip(tmp_path / "rows.zip", {"rows.csv": "text,label\nfine,pos\na, b,neg\n"})
    with pytest.raises(FileLayoutError) as info:
        load_splits(_cfg(str(packed)), seed=0)
    assert info.value.message == f"{packed}/rows.csv: line 3 has 3 fields but the header has 2 (text, label)"
    packed = _zip(tmp_path / "labels.zip", {"rows.csv": "text,label\nfine,pos\nempty,\n"})
    table = read_local(str(packed), "data.train_file", _cfg(str(packed)))
    assert table.source == f"{packed}/rows.csv"  # what every row's error is prefixed with


def test_an_archive_replaced_at_its_path_is_unpacked_anew(downloads, tmp_path):
    packed = _zip(tmp_path / "spam.zip", {"spam.csv": ROWS})
    assert len(_texts(str(packed))) == 12
    _zip(packed, {"spam.csv": ROWS + "one more,ham\n"})
    os.utime(packed, ns=(packed.stat().st_atime_ns, packed.stat().st_mtime_ns + 10**9))
    assert _texts(str(packed))[-1] == "one more"
    unpacked = tmp_path / "downloads" / "unpacked"
    assert len([folder for folder in unpacked.iterdir() if folder.is_dir()]) == 2


def test_a_copy_another_process_unpacked_first_is_the_one_read(downloads, tmp_path, monkeypatch):
    """The processes of a launch unpack at once: each aside, and the first whole copy stays."""
    from finetune import archives

    packed = _zip(tmp_path / "spam.zip", {"spam.csv": ROWS})
    replace = os.replace

    def another_process_first(aside, folder):
        replace(Path(aside), Path(folder))  # the other's copy, as whole as ours
        Path(aside).mkdir()
        (Path(aside) / "spam.csv").write_text("text,label\nnot,read\n", encoding="utf-8")
        replace(Path(aside), Path(folder))  # ours: refused, since the place is taken (ENOTEMPTY)

    monkeypatch.setattr(archives.os, "replace", another_process_first)
    assert len(_texts(str(packed))) == 12
    assert not [entry for entry in (tmp_path / "downloads" / "unpacked").iterdir() if entry.name.startswith(".")]


def test_the_processes_of_a_launch_unpack_an_archive_once(downloads, tmp_path, monkeypatch):
    """One unpacks while the others wait on its lock, then read its copy."""
    import threading
    import time

    from finetune import archives

    packed = _zip(tmp_path / "spam.zip", {"spam.csv": ROWS})
    unpacks, unpack = [], archives._unpack

    def slowly(archive, folder):
        unpacks.append(folder)
        time.sleep(0.5)  # long enough for the other to arrive while it works
        unpack(archive, folder)

    monkeypatch.setattr(archives, "_unpack", slowly)
    folders = []
    workers = [threading.Thread(target=lambda: folders.append(archives.unpacked(packed, "data.train_file")))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(unpacks) == 1 and folders[0] == folders[1] and (folders[0] / "spam.csv").is_file()


def _cut_short(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


def _marked_encrypted(raw: bytes) -> bytes:
    """The zip with its member marked encrypted in the central directory (bit 0 of the flags, at offset 8), as a
    zip made with a password is: Python's zipfile writes no encryption of its own."""
    at = raw.rindex(b"PK\x01\x02")
    return raw[:at + 8] + bytes([raw[at + 8] | 1]) + raw[at + 9:]


@pytest.mark.parametrize("damage, message, hint", [
    (_cut_short, "BadZipFile: File is not a zip file", "it may be cut short, or not an archive: unzip -t {path} "
                                                       "tests it"),
    (_marked_encrypted, "spam.csv is encrypted", "unpack it with its password (unzip {path}) and pass the file it "
                                                 "holds"),
])
def test_an_archive_that_cannot_be_unpacked_is_one_line(downloads, tmp_path, damage, message, hint):
    path = _zip(tmp_path / "spam.zip", {"spam.csv": ROWS})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError) as info:
        load_splits(_cfg(str(path)), seed=0)
    assert info.value.message == f"data.train_file: {path}: cannot unpack: {message}"
    assert info.value.hint == hint.format(path=path)
    assert not [entry for entry in (tmp_path / "downloads" / "unpacked").iterdir()
                if not entry.name.endswith(".lock")]  # no copy, whole or partial


def test_an_archive_too_large_for_the_cache_is_told_where_the_cache_moves(downloads, tmp_path, monkeypatch):
    import shutil

    packed = _zip(tmp_path / "spam.zip", {"spam.csv": ROWS})
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(DataError) as info:
        load_splits(_cfg(str(packed)), seed=0)
    assert info.value.message == (f"data.train_file: {packed}: cannot unpack: its files take 0.0GB and the cache's "
                                  f"disk has 0.0GB free")
    assert info.value.hint == "HF_DATASETS_CACHE=<a folder on a disk with room> moves the cache"


def test_a_tar_member_named_outside_the_archive_or_a_link_is_not_unpacked(downloads, tmp_path):
    packed = tmp_path / "evil.tar"
    with tarfile.open(packed, "w") as tar:
        for name, data in (("../outside.csv", b"text,label\nx,y\n"), ("spam.csv", ROWS.encode())):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
        link = tarfile.TarInfo("passwd.csv")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    assert len(_texts(f"{packed}/spam.csv")) == 12
    unpacked = next(entry for entry in (tmp_path / "downloads" / "unpacked").iterdir() if entry.is_dir())
    assert sorted(p.name for p in unpacked.iterdir()) == ["spam.csv"]
    assert not (unpacked.parent / "outside.csv").exists()


def test_a_file_of_escaped_quotes_in_an_archive_or_at_a_url_is_named_as_given(downloads, tmp_path, caplog):
    """A file whose quotes are written \" is read from a copy made from the archive's copy, or the download: its
    errors name it by its path in the archive, or by its URL, never by the copy's path; its notes as the
    archive's or the download's."""
    escaped = 'text,label\n"she said \\"hi\\"",a\n"unlabelled",\n'
    packed = _zip(tmp_path / "export.zip", {"reviews.csv": escaped})
    site = tmp_path / "site"
    site.mkdir()
    (site / "reviews.csv").write_text(escaped)
    with serving(site) as (url, _):
        for given in (f"{packed}/reviews.csv", f"{url}/reviews.csv"):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="finetune.data"), pytest.raises(DataError) as info:
                load_splits(_cfg(given), seed=0)
            assert info.value.message.startswith(f"{given}: 1 row without a label in column 'label' (line 3)")
            note = [m for m in caplog.messages if m.endswith("not \"\" as in CSV: read as a quote")]
            # a URL's notes name its downloaded copy, which the line before them names
            assert len(note) == 1 and "unescaped" not in note[0]
            assert note[0].startswith(given if given.startswith(str(packed)) else str(tmp_path / "downloads" / "named"))


def test_an_archive_at_a_url_reads_as_the_file_it_holds_and_is_named_by_its_url(downloads, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _zip(site / "sms.zip", {"spam.csv": ROWS, "README.md": "SMS texts"})
    _zip(site / "bad.zip", {"spam.csv": "text,label\nfine,pos\na, b,neg\n"})
    with serving(site) as (url, _):
        assert len(_texts(f"{url}/sms.zip")) == 12
        with pytest.raises(FileLayoutError, match=rf"^{url}/bad\.zip/spam\.csv: line 3 has 3 fields"):
            load_splits(_cfg(f"{url}/bad.zip"), seed=0)
