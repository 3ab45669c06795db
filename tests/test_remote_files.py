"""A data file given as a URL: downloaded through datasets' cache and read as the file it names.

The URLs are served by an HTTP server the tests start on this machine's loopback (``helpers.serving``), with
ETags as web servers send them; nothing leaves the machine.
"""

from __future__ import annotations

import gzip
import logging

import datasets
import pytest

from finetune.config import DataConfig
from finetune.data import load_splits
from finetune.errors import DataError
from finetune.remote_files import local_copy
from finetune.resources import data_name, file_name
from helpers import make_texts, serving, write_csv


@pytest.fixture
def site(tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    with serving(folder) as (url, requests):
        yield folder, url, requests


def _cfg(train_file: str) -> DataConfig:
    return DataConfig(train_file=train_file, validation_split=0.0)


def test_a_url_trains_as_the_file_it_names(downloads, site, tmp_path):
    folder, url, _ = site
    plain = write_csv(tmp_path / "reviews.csv", make_texts(20, seed=3))
    (folder / "reviews.csv.gz").write_bytes(gzip.compress(plain.read_bytes()))
    address = f"{url}/reviews.csv.gz?raw=true"  # a query, as a code host's "raw" link has
    expected, expected_labels = load_splits(_cfg(str(plain)), seed=0)
    splits, labels = load_splits(_cfg(address), seed=0)
    assert splits["train"].to_list() == expected["train"].to_list() and len(expected["train"]) == 20
    assert labels.names == expected_labels.names
    # named as the file is: the start line's name, and the output folder --data names
    assert (file_name(address), data_name(address)) == ("reviews.csv.gz", "reviews")


def test_a_url_is_downloaded_once_checked_by_its_etag_and_read_offline_from_that_copy(downloads, site, caplog):
    folder, url, requests = site
    (folder / "texts.csv").write_text("text,label\nfirst,a\n", encoding="utf-8")
    first = local_copy(f"{url}/texts.csv", "--file")
    again = local_copy(f"{url}/texts.csv", "--file")
    assert again == first and again.name == "texts.csv"
    assert [r for r in requests if r.startswith("GET")] == ["GET /texts.csv 200"]  # the second asked its ETag alone

    (folder / "texts.csv").write_text("text,label\nsecond,b\n", encoding="utf-8")  # a new ETag
    assert local_copy(f"{url}/texts.csv", "--file").read_text(encoding="utf-8") == "text,label\nsecond,b\n"

    datasets.config.HF_HUB_OFFLINE = True  # the monkeypatch of `downloads` puts it back
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        offline = local_copy(f"{url}/texts.csv", "--file")
    assert offline.read_text(encoding="utf-8") == "text,label\nsecond,b\n"
    assert caplog.records[-1].getMessage().startswith(f"{url}/texts.csv cannot be reached (OfflineModeIsEnabled: ")
    assert "reading the copy downloaded on" in caplog.records[-1].getMessage()
    with pytest.raises(DataError, match=rf"--file: cannot download {url}/other\.csv: OfflineModeIsEnabled"):
        local_copy(f"{url}/other.csv", "--file")  # never downloaded: nothing to read


def test_a_url_that_cannot_be_downloaded_is_one_line(downloads, site):
    _, url, _ = site
    with pytest.raises(DataError, match=rf"data\.train_file: cannot download {url}/missing\.csv: \w+: 404"):
        load_splits(_cfg(f"{url}/missing.csv"), seed=0)
    with pytest.raises(DataError, match=rf"data\.train_file: {url}/ names no file"):
        load_splits(_cfg(f"{url}/"), seed=0)
    # a protocol whose fsspec package is not installed (s3fs for s3://, which some machines have)
    with pytest.raises(DataError, match=r"cannot download dropbox://folder/x\.csv: ModuleNotFoundError") as info:
        load_splits(_cfg("dropbox://folder/x.csv"), seed=0)
    assert info.value.hint == ("fsspec reads dropbox:// with the package dropboxdrivefs (pip install "
                               "dropboxdrivefs), or copy the file here and pass it")


def test_a_urls_errors_name_the_url_not_its_downloaded_copy(downloads, site):
    folder, url, _ = site
    (folder / "rows.csv").write_text("text,label\nfine,pos\na, b,neg\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_splits(_cfg(f"{url}/rows.csv"), seed=0)
    assert info.value.message == f"{url}/rows.csv: line 3 has 3 fields but the header has 2 (text, label)"
    # a table's later messages (its labels, at their lines) name it too
    (folder / "train.csv").write_text("text,label\none,pos\ntwo,neg\n", encoding="utf-8")
    (folder / "val.csv").write_text("text,label\nthree,pos\nfour,maybe\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{url}/val\.csv: label 'maybe' at line 3 not among the 2 labels"):
        load_splits(DataConfig(train_file=f"{url}/train.csv", validation_file=f"{url}/val.csv"), seed=0)


def test_a_web_page_in_place_of_the_file_is_refused_with_the_files_own_url(downloads, site):
    from finetune.remote_files import _raw_url

    folder, url, _ = site
    # what a code host answers for the page that shows a file: its reader would take the markup for rows
    (folder / "train.csv").write_text('\n<!DOCTYPE html>\n<html lang="en"><head><title>train.csv</title>',
                                      encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_splits(_cfg(f"{url}/train.csv"), seed=0)
    assert info.value.message == f"data.train_file: {url}/train.csv is a web page (HTML), not the data file"
    assert info.value.hint == "give the URL of the file itself (a 'raw' or 'download' link)"
    assert _raw_url("https://github.com/someone/reviews/blob/main/data/train.csv") == (
        "https://raw.githubusercontent.com/someone/reviews/main/data/train.csv")
    assert _raw_url("https://huggingface.co/datasets/someone/reviews/blob/main/train.csv") == (
        "https://huggingface.co/datasets/someone/reviews/resolve/main/train.csv")
    assert _raw_url("https://www.dropbox.com/scl/fi/abc/train.csv?rlkey=x&dl=0") == (
        "https://www.dropbox.com/scl/fi/abc/train.csv?rlkey=x&dl=1")
    assert _raw_url("https://example.com/train.csv") is None


def test_where_the_file_system_has_no_links_the_copy_is_a_copy(downloads, site, monkeypatch):
    folder, url, _ = site
    (folder / "texts.csv").write_text("text,label\nfirst,a\n", encoding="utf-8")

    def no_links(self, target):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(type(folder), "symlink_to", no_links)
    copy = local_copy(f"{url}/texts.csv", "--file")
    assert copy.name == "texts.csv" and not copy.is_symlink()
    assert copy.read_text(encoding="utf-8") == "text,label\nfirst,a\n"
    (folder / "texts.csv").write_text("text,label\nsecond,b\n", encoding="utf-8")
    assert local_copy(f"{url}/texts.csv", "--file").read_text(encoding="utf-8") == "text,label\nsecond,b\n"


def test_a_url_without_an_extension_reads_once_its_format_is_named(downloads, site, tmp_path):
    # a spreadsheet's CSV export: .../export?format=csv names no extension
    folder, url, _ = site
    plain = write_csv(tmp_path / "sheet.csv", make_texts(12, seed=2))
    (folder / "export").write_bytes(plain.read_bytes())
    with pytest.raises(DataError, match=rf"^data\.train_file: {url}/export\?format=csv: unsupported extension "
                                        r"'\(none\)'") as info:
        load_splits(_cfg(f"{url}/export?format=csv"), seed=0)
    assert info.value.hint == "without an extension, the format is named: data.format=csv (or tsv, json, parquet)"
    named = DataConfig(train_file=f"{url}/export?format=csv", format="csv", validation_split=0.0)
    expected, _ = load_splits(_cfg(str(plain)), seed=0)
    assert load_splits(named, seed=0)[0]["train"].to_list() == expected["train"].to_list()


def test_a_private_file_is_told_how_to_give_credentials(downloads, tmp_path):
    folder = tmp_path / "private_site"
    folder.mkdir()
    (folder / "secret.csv").write_text("text,label\na,b\n", encoding="utf-8")
    with serving(folder, private=("secret.csv",)) as (url, _):
        with pytest.raises(DataError, match=rf"^data\.train_file: cannot download {url}/secret\.csv: \w+: 403") \
                as info:
            load_splits(_cfg(f"{url}/secret.csv"), seed=0)
    assert info.value.hint.startswith("the server asks who you are: a Hub file reads once `hf auth login`")


def test_a_url_is_asked_of_its_server_once_as_the_run_reads_it(downloads, site, tmp_path):
    folder, url, requests = site
    (folder / "reviews.csv").write_bytes(write_csv(tmp_path / "reviews.csv", make_texts(12, seed=2)).read_bytes())
    load_splits(_cfg(f"{url}/reviews.csv"), seed=0)
    assert requests == ["HEAD /reviews.csv 200", "GET /reviews.csv 200"]
