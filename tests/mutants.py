"""Deliberate bugs in the code of the package's promises, each of which the tests must catch.

A test that still passes when the feature it guards is broken guards nothing. Each mutant below breaks one rule in
one line of the package and names the test files that must fail on it: a rule of docs/accumulation.md (clipping
skipped, the ragged window weighted as a full one, the schedule stepped on a step fp16's grad scaler skipped, ...);
of docs/checkpoints.md, that a resumed run goes on as if it had not stopped (the schedule, the random streams, the
position in the epoch, the evaluations and the log restored; a damaged or another run's checkpoint refused), and
that no run deletes what it was not told to; of docs/errors.md, that bad input gets one line naming the key, file or
row, and an exit code, without a traceback; of the scores a run reports (docs/inference.md); of docs/memory.md, that
the memory levers (gradient checkpointing, frozen blocks, LoRA, the memory plan and what it offers) change what a
micro-batch costs and never the update, and that the plan counts what they save; of docs/performance.md, that the
CPU speed-ups and the GPU levers change how a micro-batch is computed, never its update; of docs/sweeps.md, that a
sweep finds, reports and repeats the best trial, within its budget, pruning at the texts seen; of docs/scaling.md,
that one run config runs on any number of processes, each with its share of the machine; of docs/long_texts.md, what
a long text keeps; of docs/inference.md, that a prediction is the run's model on each text, in the input's order; of
docs/logging.md, that a record says what its updates did and that a resumed run goes on with its tracker runs; of
docs/configuration.md, what a run is judged on and by (the validation carve, when evaluations are made, the best
model, early stopping), that a file of the user's own is read as meant (its separator, its labels' classes) and what
a dry run says; or that a run writes what README.md's table says, never replacing a file the user wrote. The check
copies the checkout's tracked files into a scratch folder, applies one mutant at a time there, runs its tests
(without the GPU ones) and restores the line: the checkout itself is never changed.

    python tests/mutants.py                     # every mutant: about 228 minutes on 2 CPU cores
    python tests/mutants.py --rules resume      # one promise's: accumulation, resume, input, scores, memory, sweep,
                                                #   long_texts, inference, logging, evaluation, data, outputs,
                                                #   trackers, scaling, keeping, dry_run, cpu, gpu_levers
    python tests/mutants.py --rules memory,sweep  # several
    python tests/mutants.py --only 0,7          # some of them (their numbers: --list)

It prints KILLED or SURVIVED for each and exits 1 if one survived. It is not part of the test suite (each mutant
runs a few test files), but a fast test holds each mutant's line to the code, so a change that moves one says so.
Written by hand: mutation-testing tools (mutmut, cosmic-ray) draw thousands of mutants, most of them in code no
rule touches, and cannot be told which tests answer for which rule.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTRACT = ("tests/test_accumulation.py", "tests/test_nonfinite.py")
SCALING = ("tests/test_scaling.py",)
RESUME = ("tests/test_checkpoint.py", "tests/test_never_lose_a_run.py")


@dataclass(frozen=True)
class Mutant:
    module: str  # under finetune/
    line: str  # the text replaced, which must occur once in the module
    bug: str  # what replaces it
    rule: str  # the rule it breaks, in words
    tests: tuple[str, ...]  # the test files that must fail


ACCUMULATION_MUTANTS = (
    # the window arithmetic (finetune/accumulation.py)
    Mutant("accumulation.py", "return math.ceil(micro_batches_per_process / k)",
           "return micro_batches_per_process // k or 1", "the ragged last window is dropped from the count",
           CONTRACT),
    Mutant("accumulation.py", "return first, min(first + k, self.micro_batches_per_process)",
           "return first, first + k", "the last window runs past the epoch", CONTRACT),
    Mutant("accumulation.py", "start = (j * self.num_processes + p) * self.batch_size",
           "start = (j + p * self.num_processes) * self.batch_size",
           "the real samples counted as if each process took a block of batches", CONTRACT + SCALING),
    Mutant("accumulation.py", "return self._real_before(stop * per_step) - self._real_before(first * per_step)",
           "return (stop - first) * per_step", "a window counts its padding repeats as samples", CONTRACT),
    Mutant("accumulation.py", "global_batches = math.ceil(self.num_samples / self.batch_size)",
           "global_batches = self.num_samples // self.batch_size", "the short last micro-batch is not counted",
           CONTRACT),
    Mutant("accumulation.py", "return sum(self.sizes[first:stop])",
           "return len(self.sizes[first:stop]) * self.batch_size",
           "balanced micro-batches counted as full ones", ("tests/test_balanced_micro_batches.py",) + CONTRACT),
    Mutant("accumulation.py",
           "return accelerator.gradient_accumulation_steps * accelerator.num_processes / real_samples_in_window",
           "return accelerator.gradient_accumulation_steps / real_samples_in_window",
           "DDP's mean over processes is not undone", SCALING),
    Mutant("accumulation.py", "derived = B // (b * num_processes)", "derived = B // b",
           "k derived from the effective batch without the processes", ("tests/test_auto_batch.py",) + SCALING),
    Mutant("autobatch.py", "return per_process & -per_process", "return per_process",
           "the automatic micro-batch starts at B / P, which halving may not divide",
           ("tests/test_auto_batch.py",)),
    Mutant("autobatch.py", "k = effective_batch_size // (b * num_processes)", "k = effective_batch_size // b",
           "the automatic micro-batch's k forgets the processes", ("tests/test_auto_batch.py",) + SCALING),
    Mutant("accumulation.py", "return changes[max(keys)] if keys else changes[min(changes)]",
           "return changes[min(keys)] if keys else changes[min(changes)]",
           "an accumulation schedule's later k never applies", ("tests/test_accumulation_schedule.py",)),
    Mutant("run.py", "            accumulate_as(self.accelerator, self.batching, epoch)\n", "\n",
           "a run's epochs (fit's, and a notebook's loop) keep epoch 0's k under an accumulation schedule",
           ("tests/test_notebooks.py",)),
    Mutant("run.py", "if self.state.step >= self.plan.total_updates:", "if False:",
           "a run's epochs go on past the plan's last update (training.max_steps)", ("tests/test_notebooks.py",)),
    # the loop (finetune/loop.py)
    Mutant("loop.py", "per_sample = torch.where(keep, per_sample, torch.zeros_like(per_sample))", "pass",
           "samples repeated to even out processes weigh in the update", SCALING),
    Mutant("loop.py", "return per_sample.sum(), tokens[:real].sum()", "return per_sample.sum(), tokens.sum()",
           "repeated samples' tokens are counted", SCALING),
    Mutant("loop.py", "window.add(j, loss_sum.detach(), real, tokens)",
           "window.add(j, loss_sum.detach(), batch['labels'].shape[0], tokens)",
           "the logged loss averages over repeated samples too", SCALING),
    Mutant("loop.py", "max_grad_norm if max_grad_norm else float(\"inf\")", "float(\"inf\")",
           "the window's gradient is never clipped", CONTRACT),
    Mutant("loop.py", "grad_norm = clip_gradients(model, accelerator, max_grad_norm)",
           "grad_norm = clip_gradients(model, accelerator, max_grad_norm); "
           "grad_norm = clip_gradients(model, accelerator, max_grad_norm)",
           "the norm is logged after clipping, not before", CONTRACT),
    Mutant("loop.py", "if scheduler is not None and not step_was_skipped(accelerator, scale):",
           "if scheduler is not None:", "the schedule steps on an update fp16's grad scaler skipped", CONTRACT),
    Mutant("loop.py", "elif grad_norm is not None and accelerator.scaler is None and not math.isfinite(grad_norm):",
           "elif False:", "a finite loss with a non-finite gradient is applied", CONTRACT),
    Mutant("loop.py", "if state.skipped_in_row >= max_skipped:", "if state.skipped_in_row > max_skipped:",
           "one skipped update more than training.max_skipped is allowed", CONTRACT),
    Mutant("loop.py", "if start % k != 0 and start != micro_batches:", "if False:",
           "a resume inside a window splits its update", CONTRACT),
    Mutant("loop.py", "    set_epoch(skipping, epoch)\n", "\n",
           "a resume mid-epoch takes the first epoch's order", CONTRACT),
    Mutant("loop.py", "state.micro_batch, state.epoch = 0, epoch + 1", "state.micro_batch = 0",
           "a finished epoch is not counted", CONTRACT),
    Mutant("loop.py", '"train/loss": float(self.totals[0] / self.totals[1]),',
           '"train/loss": float(self.totals[0] / self.totals[1]) / self.k,', "the logged loss is divided by k",
           CONTRACT),
    Mutant("loop.py", '"train/lr": self.lr_sum / self.updates,', '"train/lr": self.lr_sum,',
           "a record of several updates sums their learning rates", CONTRACT),
    Mutant("loop.py", "        return Update(lr, grad_norm)\n    if accelerator.scaler",
           "        return Update(float(optimizer.param_groups[0]['lr']), grad_norm)\n    if accelerator.scaler",
           "the log gives the next update's learning rate", CONTRACT),
    Mutant("loop.py", "return self.updates > 0 and (window_number % log_every == 0 or last)",
           "return self.updates > 0 and (window_number % log_every == 0)", "the epoch's last updates go unlogged",
           CONTRACT),
    Mutant("loop.py", "self._loss_samples += float(totals[1])", "self._loss_samples += float(totals[1] > 0)",
           "an epoch's loss (train_one_epoch's result) averages updates, not samples", CONTRACT),
    Mutant("loop.py", "self.samples_seen += int(totals[1])", "self.samples_seen += int(totals[1]) // 2",
           "the samples seen are miscounted", CONTRACT),
    Mutant("loop.py", "self.totals[2] += tokens.double()", "self.totals[2] += tokens.double() * 0",
           "tokens are not counted", CONTRACT),
    Mutant("loop.py", "            self.loss_sum += float(totals[0])\n",
           "            self.loss_sum += float(totals[0]) / 2\n", "the run's mean training loss is wrong",
           ("tests/test_selection.py",)),
    Mutant("loop.py", "casts.keep()  # the window's", "pass  # the window's",
           "cast_once_per_update casts in every micro-batch", ("tests/test_weight_casts.py",)),
    Mutant("loop.py", "optimizer.zero_grad(set_to_none=frees_gradients(model, graphs))",
           "optimizer.zero_grad(set_to_none=False)", "gradients are kept between updates", CONTRACT),
    Mutant("loop.py", "to_mean = self.real_samples / (processes * real)", "to_mean = self.real_samples / real",
           "the noise scale's small batch is misread on several processes", ("tests/test_noise_scale.py",) + SCALING),
    # the update plan (finetune/optimization.py)
    Mutant("optimization.py", "counts.append(full if epoch + 1 <= n else math.ceil((n - epoch) * full))",
           "counts.append(full if epoch + 1 <= n else int((n - epoch) * full))",
           "a fractional last epoch loses an update", ("tests/test_schedules.py", "tests/test_accumulation_schedule.py")),
    Mutant("optimization.py", "warmup = warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total)",
           "warmup = warmup_steps if warmup_steps > 0 else int(warmup_ratio * total)",
           "warmup_ratio rounds down", ("tests/test_schedules.py",) + CONTRACT),
    Mutant("optimization.py",
           "counts.append(updates_per_epoch(micro_batches_per_epoch, schedule.k_at(len(counts))))",
           "counts.append(updates_per_epoch(micro_batches_per_epoch, schedule.k_at(0)))",
           "max_steps sizes the schedule with epoch 0's k throughout", ("tests/test_accumulation_schedule.py",)),
    # per-sample losses (finetune/tasks.py) and long texts (finetune/chunks.py)
    Mutant("tasks.py", "loss = loss * self.class_weights.to(loss.device)[labels]", "loss = loss",
           "class weights are ignored", ("tests/test_problem_types.py",)),
    Mutant("tasks.py", 'reduction="none").mean(-1)', 'reduction="none").sum(-1)',
           "a multi-label sample's loss sums its labels", ("tests/test_problem_types.py",)),
    Mutant("tasks.py", "label_smoothing=self.label_smoothing)", "label_smoothing=0.0)",
           "label smoothing is ignored", ("tests/test_problem_types.py",)),
    Mutant("tasks.py", "return (logits.squeeze(-1) - labels.float()) ** 2",
           "return (logits.squeeze(-1) - labels.float()).abs()", "a regression's loss is not the squared error",
           ("tests/test_problem_types.py",)),
    Mutant("chunks.py", "return summed / present.sum(dim=1, keepdim=True)", "return summed",
           "a long text's windows are summed, so it weighs by its length", ("tests/test_chunks.py",)),
    Mutant("chunks.py",
           "summed = torch.where(present.unsqueeze(-1), windows, torch.zeros_like(windows)).sum(dim=1)",
           "summed = windows.sum(dim=1)", "absent windows add logits", ("tests/test_chunks.py",)),
    # the training order (finetune/sampling.py)
    Mutant("sampling.py", "gen = torch.Generator().manual_seed(self.seed + self.epoch)",
           "gen = torch.Generator().manual_seed(self.seed)", "every epoch has the same order",
           ("tests/test_epoch_order.py", "tests/test_balanced_micro_batches.py")),
    Mutant("sampling.py", "out += [tail] if tail is not None else []",
           "out = ([tail] if tail is not None else []) + out", "the short window comes first, not last",
           ("tests/test_epoch_order.py", "tests/test_balanced_micro_batches.py") + CONTRACT),
    Mutant("sampling.py", "padded = -(-lengths // self.multiple) * self.multiple  # as the collator pads",
           "padded = lengths  # as the collator pads", "micro-batches cut by lengths the collator does not pad to",
           ("tests/test_balanced_micro_batches.py",)),
    # the gradient noise scale (finetune/noise_scale.py)
    Mutant("noise_scale.py", "weight = 1.0 / (b_big - b_small)", "weight = 1.0 / b_big",
           "the noise scale's estimates are weighed wrongly", ("tests/test_noise_scale.py",)),
    Mutant("noise_scale.py", "return state.noise_trace / state.noise_gradient",
           "return state.noise_gradient / state.noise_trace", "the noise scale is inverted",
           ("tests/test_noise_scale.py",)),
    # evaluation (finetune/evaluation.py)
    Mutant("evaluation.py", 'gathered = accelerator.gather_for_metrics((loss, answers, batch["labels"], *apart))',
           'gathered = accelerator.gather((loss, answers, batch["labels"], *apart))',
           "an evaluation scores repeated samples twice", SCALING),
)

# a resume goes on as if the run had not stopped (docs/checkpoints.md): what a checkpoint saves
# (finetune/checkpoint.py), ...
RESUME_MUTANTS = (
    Mutant("checkpoint.py",
           'run.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))',
           "pass", "a resumed run's schedule starts again from its first update", RESUME),
    Mutant("checkpoint.py", "setattr(run.state, key, value)",
           'setattr(run.state, key, 0 if key == "micro_batch" else value)',
           "a resumed epoch starts again from its first micro-batch", RESUME),
    Mutant("checkpoint.py", "            acc.load_state(str(path))",
           "            acc.load_state(str(path)); torch.manual_seed(0)",
           "the random streams (dropout's masks) start afresh on resume", RESUME),
    Mutant("checkpoint.py", "if torch.equal(torch.get_rng_state(), sentinel) and not fresh_streams:", "if False:",
           "a checkpoint whose random states were not restored resumes, not exactly", RESUME),
    Mutant("checkpoint.py", "    check_finite(run, path)\n", "    pass\n",
           "a checkpoint of NaN weights is resumed", RESUME),
    Mutant("checkpoint.py", "reseed(run.cfg.training.seed, run.state.step)", "pass",
           "resumed on another split, a process goes on with another process's random streams",
           ("tests/test_resplit.py",) + SCALING),
    Mutant("loop.py", "return asdict(self)", 'return {**asdict(self), "loss_sum": 0.0, "loss_samples": 0}',
           "a resumed run's mean training loss leaves out the updates before its stop", RESUME),
    Mutant("loop.py", "        accelerator.step = start", "        pass",
           "resumed on another split, Accelerate ends the windows by the count of the old k",
           ("tests/test_resplit.py",) + SCALING),
    Mutant("checkpoint.py", '"history": history,', '"history": [],',
           "the evaluations before a stop are forgotten on resume", RESUME + ("tests/test_selection.py",)),
    Mutant("checkpoint.py", '"pending_eval_epoch": pending_eval_epoch,', '"pending_eval_epoch": None,',
           "an epoch's evaluation that a stop put off is never made", RESUME),
    Mutant("checkpoint.py", "prune(root, run.cfg.output.keep_last, keep={final, protect})",
           "prune(root, run.cfg.output.keep_last, keep={final})",
           "the best model's checkpoint is pruned by output.keep_last", ("tests/test_selection.py",) + RESUME),
    # ... its files (finetune/checkpoint_files.py), ...
    Mutant("checkpoint_files.py", 'if _sha256(file) != entry["sha256"]:', "if False:",
           "a checkpoint whose bytes changed, its sizes not, is resumed", RESUME),
    Mutant("checkpoint_files.py", "return [found[step] for step in sorted(found)]",
           "return [found[step] for step in sorted(found, reverse=True)]",
           "a run resumes its oldest checkpoint", RESUME),
    Mutant("checkpoint_files.py",
           "for path in others[: max(0, len(others) - max(0, keep_last - len(kept)))]:",
           "for path in others[max(0, keep_last - len(kept)):]:",
           "output.keep_last keeps the oldest checkpoints", RESUME + ("tests/test_selection.py",)),
    # ... when one is saved and what is restored (finetune/checkpointer.py, finetune/resplit.py), ...
    Mutant("checkpointer.py",
           "elif self.every and state.step % self.every == 0 and (self._saved_at or (-1,))[0] != state.step:",
           "elif False:", "output.checkpoint_every saves nothing", RESUME),
    Mutant("checkpointer.py", "carry_thresholds(self.run, self.history.records)", "pass",
           "a resumed model forgets the thresholds its last evaluation chose",
           ("tests/test_thresholds.py", "tests/test_decision_threshold.py") + RESUME),
    Mutant("resplit.py", "return min(windows * new_k, micro_batches_per_process)",
           "return min(windows * old_k, micro_batches_per_process)",
           "a resume on another split goes on at the micro-batch of the old k", ("tests/test_resplit.py",) + SCALING),
    # ... what must not change (finetune/resuming.py), ...
    Mutant("resuming.py", '"data.train_sha256": getattr(run, "data_sha256", None),', '"data.train_sha256": None,',
           "a data file edited in place resumes as the same run", RESUME),
    Mutant("resuming.py", '    "training.on_nonfinite",', '    "training.on_nonfinite", "optim.learning_rate",',
           "a resume with another learning rate goes on", RESUME),
    Mutant("resuming.py", "    for path in reversed(candidates):", "    for path in candidates:",
           "output.resume_from: auto takes the oldest checkpoint", RESUME),
    # ... and the loop, the log, the trackers and the stop (finetune/loop.py, fitting.py, selection.py, signals.py)
    Mutant("loop.py", "skipping = accelerator.skip_first_batches(dataloader, start)", "skipping = dataloader",
           "a resumed epoch trains its first micro-batches again", RESUME + CONTRACT),
    Mutant("fitting.py", "end_of_epoch(pending_eval)  # the run", "pass  # the run",
           "an epoch's evaluation that a stop put off is never made", RESUME),
    Mutant("fitting.py", "eval_due = finished and evaluations.due.at_epoch_end(run.state.step)", "eval_due = False",
           "a signal after an epoch's last update leaves its evaluation unmade", RESUME),
    Mutant("fitting.py", "continued = start_trackers(acc, cfg, resume_step=run.state.step if resuming else None)",
           "continued = start_trackers(acc, cfg, resume_step=None)",
           "a resumed run starts new tracker runs", RESUME + ("tests/test_trackers.py",)),
    Mutant("fitting.py", "resume_step=run.state.step if resuming else None, history=history.records,",
           "resume_step=None, history=history.records,",
           "a resumed run's log repeats the updates after its checkpoint", RESUME),
    Mutant("selection.py", "self.records[:] = records", "pass",
           "the evaluations before a stop are forgotten on resume", RESUME + ("tests/test_selection.py",)),
    Mutant("signals.py", 'local = int(accelerator.reduce(flag, reduction="max").item())', "local = int(flag.item())",
           "processes stop after different updates when one of them is signalled", RESUME),
)

# bad input gets one line naming the key, file or row, and an exit code, without a traceback (docs/errors.md)
ERRORS = ("tests/test_errors.py", "tests/test_cli.py")
INPUT_MUTANTS = (
    Mutant("local_files.py",
           "    starts = record_lines(path, sep, cfg.encoding, ds, skip + (header == 0), quoting_flag) \\\n",
           "    starts = None \\\n",
           "a stray quote that a later one closes runs CSV rows into one text, unsaid", ("tests/test_data.py",)),
    Mutant("local_files.py", "ds, skip + (header == 0), quoting_flag", "ds, skip, quoting_flag",
           "a row after a text of several lines is named by its count of rows, not the line it starts on",
           ("tests/test_data.py",)),
    Mutant("local_files.py", "            refuse_unpaired_quote(path, sep, cfg.encoding, quoting_flag)",
           "            pass",
           "a quote nothing closes is told as a row with too few fields", ("tests/test_data.py",)),
    Mutant("local_files.py", '    if cfg.quoting != "auto" and fmt not in ("csv", "tsv")', '    if False',
           "data.quoting set for a train file with no quotes to read (JSON Lines) is ignored, not refused",
           ("tests/test_data.py",)),
    Mutant("local_files.py", "            cfg.validation_file or cfg.test_file):", "            False):",
           "data.quoting is refused for a JSON train file although it reads the TSV validation file beside it",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "                if end > start and quoting != csv.QUOTE_NONE:\n"
           "                    refuse_unpaired_quote(path, sep, encoding, flag)\n", "",
           "a quote in the first row that nothing closes is told as a row with too few fields, and on its last line",
           ("tests/test_data.py",)),
    Mutant("train.py", 'hub, subset = text("data.dataset_name"), text("data.dataset_config")', "return None",
           "a Hub data set set on the command line trains into the shipped config's folder, where another run is",
           ("tests/test_own_data.py",)),
    Mutant("config.py", 'raise ConfigError(f"{path}: unknown key{key_hint(str(key), names, prefix)}")', "continue",
           "an unknown config key is ignored", ("tests/test_config_schema.py",) + ERRORS),
    Mutant("errors.py", "        return exc.exit_code", "        return 1",
           "every refusal exits 1, whatever its kind", ERRORS),
    Mutant("errors.py", 'print(f"hint: {exc.hint}", file=sys.stderr)', "pass",
           "the hint that says how to go on is not printed", ERRORS),
    Mutant("errors.py", "    except KeyboardInterrupt:", "    except ArithmeticError:",
           "Ctrl-C while a run loads its data or model prints a traceback", ERRORS),
    Mutant("errors.py", "        if debug:\n            raise", "        if True:\n            raise",
           "bad input ends in a traceback", ERRORS),
    Mutant("labels.py", "unseen = [i for i, key in enumerate(keys) if key not in label2id]", "unseen = []",
           "a validation label the training data lacks is let through", ("tests/test_own_data.py",) + ERRORS),
    Mutant("labels.py", "unseen = [k for k in keys if k not in label2id]", "unseen = []",
           "a label set naming a label the training data lacks is let through",
           ("tests/test_problem_types.py",) + ERRORS),
    Mutant("standard_columns.py",
           "missing = [(key, column) for key, column, _ in wanted if column not in ds.column_names]", "missing = []",
           "a missing column is not named", ("tests/test_own_data.py",) + ERRORS),
    Mutant("data.py", 'beside = (cfg.train_file or cfg.dataset_name) if key in ("data.validation_file", '
           '"data.test_file") else None', "beside = None",
           "a validation file's missing column is told the options that would rename the training data's too",
           ("tests/test_data.py",) + ERRORS),
    Mutant("standard_columns.py",
           "mask = as_mask(pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(texts)), 0), True))",
           "mask = as_mask(pc.fill_null(pc.equal(pc.utf8_length(texts), 0), True))",
           "a text of spaces alone is taken as a text", ("tests/test_own_data.py", "tests/test_data.py") + ERRORS),
    Mutant("coerce.py", "        if isinstance(value, int) and not isinstance(value, bool):",
           "        if isinstance(value, int):", "true is taken where a whole number is asked for",
           ("tests/test_config_schema.py",) + ERRORS),
    Mutant("coerce.py", "            if not math.isfinite(float(value)):", "            if False:",
           "a learning rate of nan or inf is taken", ("tests/test_config_schema.py",) + ERRORS),
    Mutant("coerce.py", "        if isinstance(value, (bool, int, float)):", "        if False:",
           "a YAML word read as a number or a boolean is refused without saying why",
           ("tests/test_config_schema.py",) + ERRORS),
    Mutant("errors.py", "        self.refuse_unknown_options(sys.argv[1:] if args is None else args)\n"
           "        return super().parse_intermixed_args(args, namespace)",
           "        return super().parse_intermixed_args(args, namespace)",
           "a mistyped option of finetune predict or score is called a required one missing, or a text left over",
           ("tests/test_own_data.py",)),
    Mutant("key_hints.py", "own = near_option(flag, options, cutoff=max(0.75, closeness))",
           "own = near_option(flag, options)",
           "a setting mistyped as an option is told a command option further from it", ("tests/test_own_data.py",)),
    Mutant("errors.py", "# what follows is positional, a text that starts with \"-\" among them\n                return",
           "# what follows is positional, a text that starts with \"-\" among them\n                continue",
           "a text after -- that starts with '-' is refused as a mistyped option", ("tests/test_own_data.py",)),
    Mutant("output_dir.py", "    if occupied and resume is None and not cfg.output.overwrite:",
           "    if False:", "a run writes into a folder holding another run's files",
           ("tests/test_checkpoint.py",) + ERRORS),
)

# the scores a run reports are the validation texts' (docs/inference.md, docs/configuration.md's metrics)
SCORES = ("tests/test_metrics.py", "tests/test_decision_threshold.py", "tests/test_thresholds.py")
SCORE_MUTANTS = (
    Mutant("scored_files.py", "    if data_cfg.test_split_name is not None:  # --split",
           "    if False:  # --split", "finetune score --split scores every row of the file",
           ("tests/test_test_set.py",)),
    Mutant("score.py", 'split = f"-{args.split}" if args.split else ""', 'split = ""',
           "finetune score --split draws over the whole file's confusion matrix", ("tests/test_test_set.py",)),
    Mutant("model_card.py", '*([f"- Caution: {caution}"] if caution else [])]', "*[]]",
           "the model card leaves out the caution of a class the validation texts lack, which the start line gives",
           ("tests/test_model_card.py",)),
    Mutant("metrics/__init__.py", 'return "binary", names[0 if counts[0] < counts[1] else 1]',
           'return "binary", names[1 if counts[0] < counts[1] else 0]',
           "binary F1 is of the more common of two classes, not the rarer", ("tests/test_own_data.py",) + SCORES),
    Mutant("metrics/intervals.py", "tail = (1.0 - level) / 2", "tail = 1.0 - level",
           "a 95% interval holds 90% of the resamples", SCORES + ("tests/test_ranking_metrics.py",)),
    Mutant("metrics/intervals.py", "yield rng.multinomial(texts, counts / texts, size=size)",
           "yield np.repeat(counts[None], size, axis=0)", "the resamples are the texts themselves, every time",
           SCORES + ("tests/test_ranking_metrics.py",)),
    Mutant("tasks.py", "over = torch.softmax(logits.float(), dim=-1)[:, positive] > float(self.threshold)",
           "over = torch.softmax(logits.float(), dim=-1)[:, positive] >= float(self.threshold)",
           "a probability at the threshold is predicted positive", SCORES),
    Mutant("tasks.py", "return (torch.sigmoid(logits.float()) > threshold).long()",
           "return (torch.softmax(logits.float(), dim=-1) > threshold).long()",
           "several labels' probabilities share one softmax", SCORES + ("tests/test_problem_types.py",)),
    Mutant("metrics/__init__.py", 'if not chosen or not absent or average not in ("binary", "macro"):',
           'if not chosen or not absent or average not in ("macro",):',
           "a validation set without the positive class of two is not cautioned of, its F1 0 whatever is learnt",
           ("tests/test_metrics.py", "tests/test_start_of_run.py")),
    Mutant("metrics/__init__.py", "f\"{(len(support) - len(absent)) / len(support):.2f} whatever the model predicts\")",
           "f\"{1 - 1 / len(support):.2f} whatever the model predicts\")",
           "the ceiling of a macro average over absent classes is said for one absent class, whatever their number",
           ("tests/test_metrics.py",)),
    Mutant("tasks.py", "    module.__class__ = Float32Output", "    pass",
           "a regression model's output is rounded to bf16 under autocast: near 1000, one answer for every text",
           ("tests/test_problem_types.py",)),
    Mutant("start_line.py", "support = validation_support(run)", "support = None",
           "the start line says nothing of a validation set lacking a class its average scores 0",
           ("tests/test_start_of_run.py",)),
)

# the memory levers change what a micro-batch costs, never the update (docs/memory.md)
MEMORY = ("tests/test_memory_plan.py", "tests/test_auto_batch.py", "tests/test_out_of_memory.py")
LORA = ("tests/test_lora.py",)
MEMORY_MUTANTS = (
    Mutant("modeling.py", 'kwargs = {"use_reentrant": False}',
           'kwargs = {"use_reentrant": False, "preserve_rng_state": False}',
           "gradient checkpointing's recompute draws new dropout masks", CONTRACT),
    Mutant("modeling.py", "    if not on:", "    if True:", "gradient checkpointing is never switched on",
           MEMORY + CONTRACT),
    Mutant("modeling.py", 'kwargs["context_fn"] = recompute', "pass",
           "the recompute runs another attention kernel than the forward did", ("tests/test_attention_kernel.py",)),
    Mutant("modeling.py", "        model.disable_input_require_grads()", "        pass",
           "the embeddings' output keeps asking for a gradient, so frozen blocks run backwards",
           ("tests/test_freezing.py",) + MEMORY),
    Mutant("freezing.py", "if depth[id(param)] <= freeze_blocks:", "if depth[id(param)] < freeze_blocks:",
           "the highest frozen block trains", ("tests/test_freezing.py",)),
    Mutant("memory.py", "kept = self.per_row_block_input * self.blocks + self.per_row_block if checkpointing",
           "kept = self.per_row_block * self.blocks if checkpointing",
           "the plan counts nothing saved by checkpointing", MEMORY),
    Mutant("memory.py", "per_row = self.per_row_other + kept + self.per_row_block",
           "per_row = self.per_row_other + kept", "the plan leaves out the block whose backward is running", MEMORY),
    Mutant("memory.py", "fixed = max(0, round(", "fixed = 0 * max(0, round(",
           "the plan leaves out what a micro-batch saves whatever its size (autocast's weight copies)", MEMORY),
    Mutant("memory.py", "gradients=tensor_bytes(trained)", "gradients=tensor_bytes(model.parameters())",
           "the plan gives frozen weights gradients", MEMORY + LORA + ("tests/test_freezing.py",)),
    Mutant("optimizer_state.py", "return 2 * n * param.element_size()", "return n * param.element_size()",
           "the plan counts one of AdamW's two moments", MEMORY),
    Mutant("optimizer_state.py", "return 2 * (n + 4 * math.ceil(n / BLOCK) + 4 * LEVELS)", "return 2 * n",
           "the plan leaves out 8-bit state's block scales and level maps",
           ("tests/test_eight_bit_adamw.py",) + MEMORY),
    Mutant("memory.py", "return self.available is None or self.total - self.resident <= self.available",
           "return True", "a plan larger than the memory is let through", MEMORY),
    Mutant("cpu/__init__.py", "shape = rows_and_tokens(args, kwargs) if torch.is_grad_enabled() else None",
           "shape = rows_and_tokens(args, kwargs)",
           "auto's kept heap judges evaluation's batches as training's and releases the heap for them", MEMORY),
    Mutant("cpu/__init__.py", "planned = (memory.windows or memory.micro_batch) * memory.length",
           "planned = memory.micro_batch * memory.length",
           "under chunks a micro-batch's windows are judged against the plan's texts, not its windows", MEMORY),
    Mutant("cpu/__init__.py", "free // max(1, memory.processes)", "free",
           "each of several processes keeps its heap as if the memory free were its own", MEMORY),
    Mutant("memory.py", "available=None if available is None else available // processes",
           "available=available", "CPU processes on one machine each plan with all of its RAM",
           MEMORY + ("tests/test_container_limits.py",)),
    Mutant("memory.py", "k = batching.effective_batch_size // (b * batching.num_processes)",
           "k = batching.effective_batch_size // b",
           "a smaller micro-batch the plan offers forgets the processes' share of k",
           MEMORY),
    Mutant("autobatch.py", "if with_it[0] > b:", "if with_it[0] >= b:",
           "auto keeps checkpointing on where it lets no larger micro-batch fit", MEMORY),
    Mutant("autobatch.py", "useful = min(USEFUL_MICRO_BATCH, batching.per_device_batch_size)",
           "useful = USEFUL_MICRO_BATCH", "auto recomputes although the whole of B / P already fits", MEMORY),
    Mutant("out_of_memory.py", 'keep_b = "" if training.effective_batch_size is not None',
           'keep_b = "" if True', "out of memory, the hint halves b and with it the effective batch", MEMORY),
    Mutant("lora.py", "modules_to_save=list(head)", "modules_to_save=list(head)[:1]",
           "under LoRA the pooler between the blocks and the head stays frozen", LORA),
    Mutant("lora.py", "lora_alpha=cfg.lora_alpha", "lora_alpha=cfg.lora_rank", "model.lora_alpha is ignored", LORA),
    Mutant("lora.py", "lora_dropout=cfg.lora_dropout", "lora_dropout=0.0", "model.lora_dropout is ignored", LORA),
    Mutant("lora.py", "return copy.deepcopy(model).merge_and_unload()", "return copy.deepcopy(model).unload()",
           "the saved model lacks the adapters' update", LORA),
    Mutant("lora.py", "load_adapter_weights(accelerator.unwrap_model(model), Path(input_dir) / ADAPTER_DIR)",
           "pass", "a LoRA run resumes with fresh adapters", LORA + RESUME),
    Mutant("lora.py", "merge_and_unload(safe_merge=True)", "unload()",
           "a LoRA checkpoint's model predicts without its adapters", LORA),
    Mutant("lora.py", "tensor.data = tensor.data.clone()", "pass",
           "loading a LoRA checkpoint merges its update into the base weights the loader handed out", LORA),
)

# a sweep finds the best run and says how much of its score is the seed (docs/sweeps.md)
SWEEP = ("tests/test_sweep.py",)
SWEEP_MUTANTS = (
    Mutant("sweep_notes.py", "    loggers = [logging.getLogger(name) for name in NOTE_LOGGERS]", "    loggers = []",
           "each trial says again what reading the same data found, and what the command line's keys replace",
           ("tests/test_sweep.py",)),
    Mutant("sweep_notes.py", "        return self.cautioned == 1", "        return True",
           "every trial of a sweep says its caution of few updates again, in other numbers", SWEEP),
    Mutant("sweep.py", "    if few_updates.cautioned and search is not None:", "    if search is not None:",
           "a search of quick runs asked for (training.max_steps) is told its trials made too few updates", SWEEP),
    Mutant("sweep_report.py", '        lines += [f"{few_updates}.", ""] if few_updates else []', "        lines += []",
           "sweep.md leaves out that the search's trials made too few updates, which the log said", SWEEP),
    Mutant("sweep_notes.py", 'enough = -(-FEW_UPDATES * own // fewest["updates"])',
           'enough = FEW_UPDATES * own // fewest["updates"]',
           "the epochs a sweep names for its fewest updates leave them short of enough", SWEEP),
    Mutant("signals.py", "sweep = _sweep_command(command, argv)", "sweep = None",
           "a sweep stopped in a trial says to resume it with finetune train, not the sweep's own command",
           ("tests/test_checkpoint.py",)),
    Mutant("sweep.py", 'direction = "maximize" if greater else "minimize"\n    identity',
           'direction = "minimize" if greater else "maximize"\n    identity',
           "the search minimises a score that is better higher", SWEEP),
    Mutant("sweep_report.py", "best = (max if greater_is_better else min)(t.value for t in scored)",
           "best = (min if greater_is_better else max)(t.value for t in scored)",
           "the report's best trial is the worst", SWEEP),
    Mutant("sweep_report.py", "math.inf if eval_loss is None else eval_loss)",
           "math.inf if eval_loss is None else -eval_loss)",
           "equal objectives are ranked by the higher validation loss", SWEEP),
    Mutant("sweep.py", "best = winner.params if winner is not None else {}", "best = {}",
           "the seeds run the config, not the best trial's values", SWEEP),
    Mutant("sweep_file.py", "return seeds_from(max(search_seeds(sweep, seed)) + 1 if sweep.space.dimensions else "
           "seed, sweep.seeds)", "return seeds_from(seed, sweep.seeds)",
           "the seeds runs after a search count again the seed it chose the config on", SWEEP),
    Mutant("sweep_report.py", "statistics.stdev(values)", "statistics.pstdev(values)",
           "the seeds' standard deviation is the population's, not the sample's", SWEEP),
    Mutant("sweep_trial.py", "same = finished_same(phase.study, params, trial.number)", "same = None",
           "a trial whose values a finished trial had is trained again", SWEEP),
    Mutant("sweep_trial.py", "if drawn_before(phase.study, trial.number) >= phase.trials:",
           "if drawn_before(phase.study, trial.number) > phase.trials:",
           "workers drawing at once run a trial past the budget", SWEEP),
    Mutant("sweep_trial.py", "continuing=CONTINUES in trial.user_attrs", "continuing=False",
           "a trial stopped before its first checkpoint cannot be continued in its folder", SWEEP),
    Mutant("sweep_trial.py", "seen = texts_seen(run)", "seen = run.state.step",
           "a trial reports to the pruner at its updates, not the texts it has seen", SWEEP),
    Mutant("sweep_trial.py", "done = epoch_share(state.micro_batch, per_epoch, shares) / shares",
           "done = done", "an evals_per_epoch evaluation is reported where its update ended, not its share", SWEEP),
    Mutant("sweep.py", "MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup",
           "MedianPruner(n_startup_trials=startup, n_warmup_steps=0", "the pruner's warmup_texts is ignored", SWEEP),
    Mutant("sweep_trial.py", "return seen > round(warmup_epochs", "return seen >= round(warmup_epochs",
           "the evaluation that ends the pruner's warmup_epochs is judged", SWEEP),
    Mutant("sweep_trial.py", 'at = 100 - kept if trial.study.direction.name == "MAXIMIZE" else kept', "at = kept",
           "a percentile pruner's note names the percentile at the wrong end where higher is better", SWEEP),
    Mutant("sweep_trial.py", "return warmed_up and run.state.step < run.plan.total_updates and",
           "return warmed_up and", "a trial behind the median at its last evaluation is pruned, its score lost", SWEEP),
    Mutant("sweep_file.py", 'return {"type": kind, **{k: v for k, v in settings.items() if k in PRUNER_TAKES[kind]}}',
           'return {"type": kind}',
           "--pruner TYPE drops the file's warm-up and startup trials, judging trials from the first evaluation", SWEEP),
    Mutant("sweep_file.py", 'kind = settings.get("type", "median")', 'kind = settings.get("type")',
           "a pruner the file names by its settings alone (pruner: {warmup_epochs: 0.25}) prunes nothing", SWEEP),
    Mutant("search_space.py", '"training.per_device_train_batch_size": "the micro-batch',
           '"training.per_device_train_batch_sizes": "the micro-batch',
           "a search may vary the micro-batch, which is memory, not math", SWEEP),
    Mutant("sweep_checks.py", "resolve_batching(cfg.training, 1)", "pass",
           "an effective batch the micro-batch does not divide is found at its trial, not before the sweep", SWEEP),
    Mutant("carve.py", 'order = order[np.argsort(unit_labels[order], kind="stable")]', "order = order",
           "the folds are dealt without regard to the classes", SWEEP + ("tests/test_data.py",)),
    Mutant("out_of_fold.py", "if isinstance(cfg.data.label_column, list) and cfg.data.label_map is None:",
           "if False:", "out-of-fold rows of a file with a 0/1 column per label give one list column, not the file's",
           ("tests/test_sweep.py",)),
    Mutant("out_of_fold.py", "held_out = held_out_rows(cfg, fold)", "held_out = held_out_rows(cfg, 1)",
           "every fold's model predicts the first fold's rows", SWEEP + ("tests/test_predict.py",)),
    Mutant("sweep_report.py", "                           *unset])", "                           ])",
           "the command that trains the best config on every row keeps the sweep's objective, which a run without "
           "validation texts refuses", SWEEP),
    Mutant("sweep_report.py", "    if data.text_pair_column is None:\n        return f\"`{shlex.join(['finetune', 'predict', ",
           "    if True:\n        return f\"`{shlex.join(['finetune', 'predict', ",
           "the report tells a model of pairs to classify a single text, which it refuses", SWEEP),
    Mutant("sweep_report.py", 'data, folder = config_of(header, best).data, str(root / best["folder"])',
           'data, folder = config_of(header, best).data, best["folder"]',
           "the report's commands name a trial's folder from the sweep's, not from where the sweep was started",
           SWEEP),
    Mutant("sweep_report.py", 'return shlex.join(["finetune", "train", "--config", str(root / BEST_YAML), ',
           'return shlex.join(["finetune", "train", "--config", BEST_YAML, ',
           "the every-row command names best.yaml from the sweep's folder, where its relative paths are not found",
           SWEEP),
    Mutant("sweep.py", "left = sweep_so_far(sweep, greater).runs_left - 1",
           "left = sweep_so_far(sweep, greater).runs_left",
           "the disk the runs left would keep counts the trial that just finished among them", SWEEP),
    Mutant("sweep.py", 'if state == "complete" and not measured:', 'if state == "complete":',
           "a sweep short of disk says so after every trial, not once", SWEEP),
    Mutant("sweep_file.py", 'settings.setdefault("warmup_epochs", DEFAULT_WARMUP_EPOCHS)', "pass",
           "a sweep file that sets no warm-up judges trials from the first quarter, where the best ones were stopped",
           SWEEP),
    Mutant("sweep.py", "    if not space.dimensions:\n        refuse_search_settings(", "    if False:\n        refuse_search_settings(",
           "--trials in a sweep with no space is ignored: a user who asked for a search gets none without a word",
           SWEEP),
    Mutant("sweep_report.py", 'return config_of(header, best).data.test_file or "test.csv"', 'return "test.csv"',
           "the report's commands that score the models together name a stand-in, not the sweep's test file", SWEEP),
    Mutant("sweep_report.py", 'seeds = str(root / "seeds")', 'seeds = str(root / "folds")',
           "the report's commands that average the seeds' models name a folder of no runs", SWEEP),
)

# what a long text keeps, and the layer-wise learning rates (docs/long_texts.md)
LONG = ("tests/test_truncation.py", "tests/test_chunks.py")
LONG_TEXT_MUTANTS = (
    Mutant("truncation.py", "kept = content[len(content) - budget:]", "kept = content[:budget]",
           "tail keeps the text's first tokens", LONG),
    Mutant("truncation.py", "head = min(self.head, budget)", "head = budget // 2",
           "head_tail ignores data.head_tokens", LONG),
    Mutant("truncation.py", '"""A quarter of the window: 128 of 512, as Sun et al. measured best."""\n    return max_length // 4',
           '"""A quarter of the window: 128 of 512, as Sun et al. measured best."""\n    return max_length // 2',
           "head_tail's default head is half the window, not a quarter", LONG),
    Mutant("truncation.py", "kept = [*content[:head], *content[len(content) - (budget - head):]]",
           "kept = [*content[:head], *content[len(content) - (budget - head) + 1:]]",
           "head_tail keeps one token fewer than the window holds", LONG),
    Mutant("truncation.py", "return [*range(prefix), *kept, *range(total - suffix, total)]",
           "return [*range(prefix), *kept]", "a cut text loses its closing special token", LONG),
    Mutant("truncation.py", "step = budget - self.stride", "step = budget",
           "chunks' windows do not overlap by data.stride", LONG),
    Mutant("truncation.py", "starts = range(0, max(1, len(content) - self.stride), step)",
           "starts = range(0, max(1, len(content) - budget), step)",
           "chunks drop a long text's last window", LONG),
    Mutant("truncation.py", '"truncation": data.truncation', '"truncation": "head"',
           "prediction cuts a text's head whatever the run trained on", LONG + ("tests/test_predict.py",)),
    Mutant("truncation.py", 'limit -= (getattr(config, "pad_token_id", None) or 0) + 1', "limit -= 0",
           "RoBERTa's max_length may reach its 514 position slots, two past the last usable", LONG),
    Mutant("truncation.py", 'if getattr(config, "position_biased_input", True) is False:', "if False:",
           "DeBERTa-v3, which has no absolute positions, is held to 512 tokens", LONG),
    Mutant("optimization.py", '"lr": learning_rate * decay ** max(0, blocks - d)',
           '"lr": learning_rate * decay ** max(0, d)', "layer-wise rates decay upwards: the embeddings learn fastest",
           ("tests/test_layer_rates.py",)),
)

# a prediction is the run's model on each text, in the input's order (docs/inference.md)
PREDICT = ("tests/test_predict.py", "tests/test_prediction_processes.py")
ENSEMBLE = ("tests/test_ensemble.py",)
INFERENCE_MUTANTS = (
    Mutant("predictor.py", "self.precision = resolved_precision(precision, self.device)", "self.precision = precision",
           "a score of --precision auto records auto, not the arithmetic it computed in", ("tests/test_predict.py",)),
    Mutant("precisions.py", 'return choose_precision("auto", device)[0] if precision == "auto" else precision',
           'return "bf16" if precision == "auto" else precision',
           "--precision auto computes in bf16 where bf16 is emulated, slower than float32", ("tests/test_predict.py",)),
    Mutant("predict.py", "quoting=args.quoting or (cfg and cfg.data.quoting))", "quoting=args.quoting)",
           "finetune predict reads a file's quotes by auto, not as the run's data.quoting says", PREDICT),
    Mutant("predict.py", "    notes_to_stderr()  # what reading the --file found", "    pass  # ",
           "what reading the --file found (R's row names left out, texts quoted over lines) is never said",
           ("tests/test_predict.py",)),
    Mutant("predictor.py", "every = 0.1 if redraws_in_place(sys.stderr) else PROGRESS_SECONDS_IN_A_FILE", "every = 0.1",
           "predict's bar is redrawn ten times a second into a batch job's log, each redraw kept there", PREDICT),
    Mutant("prediction_files.py", '    suffix = kind or (".txt" if stdin else file_kind(',
           '    suffix = (".txt" if stdin else file_kind(',
           "a .txt file's kind told again for another column: a file the checks took as a text a line read as a table",
           PREDICT),
    Mutant("workbooks.py", '                cell.data_type = "s"  # a text, never a formula', "                pass",
           "a predicted row's text that starts with '=' is written to a workbook as a formula",
           ("tests/test_predict.py",)),
    Mutant("prediction_files.py", "        if not named:\n            return prefix, clashes",
           "        if not named or prefix == CLASH_PREFIX:\n            return prefix, clashes",
           "a file of earlier predictions loses its predicted_ columns to the new ones in the output",
           ("tests/test_predict.py",)),
    Mutant("shares.py", "logits[rows] = values", "logits[np.sort(rows)] = values",
           "predictions come back in the order they ran (longest first), not the input's", PREDICT),
    Mutant("shares.py", "order = sorted(range(len(lengths)), key=lambda row: -lengths[row])",
           "order = list(range(len(lengths)))",
           "texts run in the input's order, so a --batch-size too large shows late, not at once", PREDICT),
    Mutant("shares.py", "for start in range(0, len(order), batch_size)][part::parts]",
           "for start in range(0, len(order), batch_size)][0::parts]",
           "every launched process runs the first process's batches", PREDICT),
    Mutant("prediction_rows.py", "logits -= logits.max(axis=1, keepdims=True)", "logits -= 0",
           "the softmax is not shifted: large logits overflow to NaN probabilities", PREDICT),
    Mutant("prediction_rows.py", '"score": float(row[label])', '"score": float(row.max())',
           "the score is the top probability, not the predicted label's (under a threshold they differ)",
           PREDICT + ("tests/test_decision_threshold.py",)),
    Mutant("prediction_files.py", "filled = [i for i, text in enumerate(texts) if text.strip()]",
           "filled = list(range(len(texts)))", "an empty text gets a label instead of an empty row", PREDICT),
    Mutant("prediction_files.py", 'named = columns & {*(prefix + name for name in PREDICTED), *(f"{prefix}prob_{name}" '
           'for name in labels)}', "named = set()", "an input's own label column is overwritten by the prediction's",
           PREDICT),
    Mutant("predictor.py", "max_length = cfg.data.max_length if cfg is not None else None", "max_length = None",
           "a saved run predicts at the tokenizer's length, not the run's data.max_length", PREDICT),
    Mutant("prediction_files.py", "    return [row for row, name in zip(table.to_list(), names) if name == split]",
           "    return table.to_list()", "--split classifies every row of the file, not the split's",
           ("tests/test_predict.py",)),
    Mutant("split_column.py", "return None if value is None else str(value).strip() or None",
           "return None if value is None else str(value) or None",
           "a split written with spaces around it is a split of its own, in training and under --split",
           ("tests/test_predict.py", "tests/test_data.py")),
    Mutant("prediction_files.py", "set(columns) <= {field.strip() for field in fields} or len(fields) != len(names):",
           "set(columns) <= {field.strip() for field in fields}:",
           "a header of other names, split otherwise than the run's files, is read in the run's layout and refused",
           ("tests/test_predict.py",)),
    Mutant("prediction_files.py", '    return {"format": run_data.format, "has_header": run_data.has_header, '
           '"column_names": names}', "    return {}",
           "a file as headerless as the run's own is refused for the header it lacks", ("tests/test_predict.py",)),
    Mutant("prediction_output.py", "texts = summary[\"eval\"][\"num_samples\"] if problem_type == \"multi_label\" "
           "else sum(support.values())", "texts = sum(support.values())",
           "the summed-up line gives a multi-label run's validation shares of the labels given, not of the texts",
           ("tests/test_predict.py", "tests/test_problem_types.py")),
    Mutant("prediction_output.py", "filled = [row for row in rows if not _unpredicted(row, problem_type, prefix)]",
           "filled = rows", "the summed-up line counts an empty text as predicted, with no label",
           ("tests/test_predict.py", "tests/test_problem_types.py")),
    Mutant("prediction_files.py", '    return ".tsv" if table else kind', "    return kind",
           "a .txt file of a table's lines, which training reads by its columns, is classified a line a text, "
           "header and labels too", ("tests/test_predict.py",)),
    Mutant("prediction_output.py", 'delimiter="\\t" if suffix == ".tsv" else separator', "delimiter=separator",
           "a .tsv output is written with commas between its fields", ("tests/test_predict.py",)),
    Mutant("prediction_output.py", "ranked = sorted(counts.items(), key=lambda item: -item[1])",
           "ranked = list(counts.items())", "the summed-up line names the labels in id order, not the most given first",
           ("tests/test_predict.py", "tests/test_problem_types.py")),
    Mutant("ensemble.py", "total = outputs.astype(np.float64) if total is None else total + outputs",
           "total = outputs.astype(np.float64)", "an ensemble predicts as its last model alone", ENSEMBLE),
    Mutant("ensemble.py", 'outputs = logits if kind == "regression" else probabilities_of_logits(logits, kind)',
           "outputs = logits",
           "an ensemble averages its models' logits as if they were probabilities", ENSEMBLE),
    Mutant("ensemble.py", "                                            else 1.0 - own[1] for own in kept)}",
           "                                            else own[1] for own in kept)}",
           "a threshold a model kept on the other class is averaged as if it were on this one", ENSEMBLE),
    Mutant("ensemble.py", "        elif label_names(config) != labels:", "        elif False:",
           "models with other labels, or their labels in another order, are averaged column by column", ENSEMBLE),
    Mutant("ensemble.py", "self.alone.append((run, logits, member.task))", "self.alone = [(run, logits, member.task)]",
           "a folder's score beside its mean gives its last model's alone", ENSEMBLE),
    Mutant("ensemble.py", "self.alone.append((run, logits, member.task))",
           "self.alone.append((run, logits, self.task))",
           "each model alone is scored at the mean of the thresholds, not its own", ENSEMBLE),
    Mutant("ensemble.py", "    if unfinished and is_main_rank():", "    if False:",
           "a fold still training is left out of a folder's mean without a word", ENSEMBLE),
    Mutant("scored_files.py", "        trained |= rows", "        trained = rows",
           "an ensemble's texts seen in training are the last model's alone", ENSEMBLE),
)

# a log record says what the updates it covers did (docs/logging.md)
LOGGING_MUTANTS = (
    Mutant("errors.py", '        os.environ.setdefault("TQDM_MININTERVAL", f"{PROGRESS_SECONDS_IN_A_FILE:g}")',
           "        pass", "datasets' bars are redrawn ten times a second into a batch job's log, each redraw kept",
           ("tests/test_start_of_run.py",)),
    Mutant("loop.py", '"train/grad_norm": self.grad_norm / self.updates', '"train/grad_norm": self.grad_norm',
           "a record of several updates sums their gradient norms", CONTRACT),
    Mutant("loop.py", '"train/samples_per_s": float(self.totals[1]) / elapsed',
           '"train/samples_per_s": float(self.totals[2]) / elapsed', "samples per second counts the tokens",
           CONTRACT + ("tests/test_accumulation_schedule.py",)),
    Mutant("tracker_runs.py", '"purge_step": (resume_step or 0) + 1', '"purge_step": (resume_step or 0) + 2',
           "a resumed run's TensorBoard keeps the stopped run's first update past the checkpoint",
           ("tests/test_trackers.py",)),
    Mutant("evaluation.py", 'return same_answer_for_every_text(summary.get("eval_by_label")',
           'return None and same_answer_for_every_text(summary.get("eval_by_label")',
           "a model that gave every validation text the same answer ends without a caution",
           ("tests/test_metrics.py", "tests/test_own_data.py")),
    Mutant("tracking.py", "        if self.clock() - self.said_at >= PROGRESS_SECONDS_IN_A_FILE:",
           "        if True:", "a batch job's log gets a progress line at every update", ("tests/test_start_of_run.py",)),
    Mutant("tracking.py", "        if self.n != self.said_n:  # where the last line left off",
           "        if False:", "a batch job's log ends without the progress of the last updates",
           ("tests/test_start_of_run.py",)),
)

# what a run is judged on and by: the validation carve, when evaluations are made, the best model and early
# stopping (docs/configuration.md)
SELECTION = ("tests/test_selection.py",)
CARVE = ("tests/test_data.py",)
EVALUATION_MUTANTS = (
    Mutant("start_line.py", "    epochs = -(-FEW_UPDATES * plan.num_epochs // plan.total_updates)",
           "    epochs = FEW_UPDATES * plan.num_epochs // plan.total_updates",
           "the caution of few updates names epochs that still make too few", ("tests/test_start_of_run.py",)),
    Mutant("start_line.py", "    if not run.new_head or run.cfg.training.max_steps is not None or",
           "    if not run.new_head or", "a quick run asked for by training.max_steps is cautioned of its few updates",
           ("tests/test_start_of_run.py",)),
    Mutant("start_line.py", "plan.total_updates >= FEW_UPDATES:", "plan.total_updates >= FEW_UPDATES * 100:",
           "a run of enough updates is cautioned of few", ("tests/test_start_of_run.py",)),
    Mutant("selection.py", 'greater = not metric.endswith(("loss", "error", "mse", "mae"))',
           'greater = not metric.endswith(("loss", "error"))', "an error (mse, mae) is taken as better higher",
           SELECTION + ("tests/test_config_schema.py",)),
    Mutant("selection.py", "return gain > self.threshold", "return gain >= self.threshold",
           "an evaluation that only equals the best counts as an improvement", SELECTION),
    Mutant("selection.py", "gain = value - best if self.greater_is_better else best - value",
           "gain = abs(value - best)", "a worse evaluation counts as an improvement when it differs enough",
           SELECTION),
    Mutant("selection.py", "best, waited = record, 0", "best = record",
           "early stopping's patience counts every evaluation that did not improve, not those in a row since the best",
           SELECTION),
    Mutant("selection.py", "return patience is not None and self.evaluations_since_best >= patience",
           "return patience is not None and self.evaluations_since_best > patience",
           "early stopping waits one evaluation more than its patience", SELECTION),
    Mutant("selection.py", "return value == value  # NaN never improves", "return True",
           "a first evaluation of NaN is the best, and nothing after it improves on it", SELECTION),
    Mutant("selection.py", 'metric = (cfg.metric_for_best_model or "loss").removeprefix("eval/")',
           'metric = (cfg.metric_for_best_model or "accuracy").removeprefix("eval/")',
           "the best model and early stopping without a metric select on accuracy, not the loss",
           SELECTION + ("tests/test_config_schema.py",)),
    Mutant("selection.py", 'record["is_best"] = self.selection.judge(self.records + [record]).best is record',
           'record["is_best"] = self.selection.judge([record]).best is record',
           "every evaluation record says it is the best so far", SELECTION + ("tests/test_thresholds.py",)),
    Mutant("fitting.py", "if self.run.cfg.evaluation.load_best_model_at_end and not at_end:", "if False:",
           "load_best_model_at_end ships the last weights, not the best evaluation's",
           SELECTION + ("tests/test_test_set.py", "tests/test_lora.py")),
    Mutant("results.py", "if best is not None and run.cfg.evaluation.load_best_model_at_end:", "if False:",
           "under load_best_model_at_end, metrics.json's eval is the last evaluation's, not the saved model's",
           SELECTION + ("tests/test_test_set.py",)),
    Mutant("fitting.py", 'self.checkpoints.save(f"evaluation at update {step}")', "pass",
           "an evaluation's weights are not saved when they are seen, so the best model may not be on disk",
           SELECTION + ("tests/test_test_set.py", "tests/test_dry_run.py")),
    Mutant("fitting.py", "window_start = (micro_batch - 1) // k * k", "window_start = micro_batch - 1",
           "evals_per_epoch misses a share of the epoch completed inside a window",
           ("tests/test_dry_run.py", "tests/test_sweep.py", "tests/test_thresholds.py")),
    Mutant("fitting.py", "return bool(self.every and step % self.every == 0)",
           "return bool(self.every and micro_batch % self.every == 0)", "eval_every counts micro-batches, not updates",
           SELECTION + ("tests/test_dry_run.py",)),
    Mutant("carve.py", "return *stratified_split(train, labels, n_validation, seed), held_out",
           'return *train.train_test_split(test_size=n_validation, seed=seed).values(), held_out',
           "the validation carve is not stratified by class", CARVE),
    Mutant("carve.py", "return text_groups(train)", "return np.arange(len(train))",
           "validation_split_by: text lets copies of one text fall on both sides",
           CARVE + ("tests/test_start_of_run.py",)),
    Mutant("carve.py", "values = read_column(train, GROUP)", "values = list(range(len(train)))",
           "validation_split_by a column carves its rows one by one, not each value's together", CARVE),
    Mutant("carve.py", "n_validation = max(math.ceil(fraction * units), present)",
           "n_validation = max(int(fraction * units), present)",
           "the carve rounds the validation share down, not up as datasets does", CARVE),
    Mutant("data.py", "cfg.validation_split = held_out", "cfg.validation_split = cfg.validation_split",
           "a carve raised to one row of each class leaves the start line, the card and config.yaml saying the "
           "share asked for", CARVE),
    Mutant("carve.py", "while math.ceil(share * units) > n_validation:", "while False:",
           "the share written back for a raised carve carves one row more where the float product rounds up",
           CARVE),
    Mutant("schema.py", 'return keys + [key for key in ("load_best_model_at_end", "early_stopping_patience", '
           '"metric_for_best_model")', "return keys + [key for key in ()",
           "the best model or early stopping asked for without validation texts is skipped, unsaid", SELECTION),
    Mutant("schema.py", 'keys = ["threshold"] if self.threshold == PER_LABEL else []', "keys = []",
           "per_label thresholds without validation texts are refused as another key, or not at all", SELECTION),
    Mutant("schema.py", 'keys += [key for key in ("greater_is_better", "early_stopping_threshold") if '
           'getattr(self, key) != default[key]]', "keys += []",
           "a run on every row keeps greater_is_better, which its config then refuses with nothing compared",
           SELECTION + SWEEP),
    Mutant("resuming.py", 'SETTLED_IN_SETUP = frozenset({"data.validation_split_name", "data.validation_split"})',
           'SETTLED_IN_SETUP = frozenset({"data.validation_split_name"})',
           "a run whose carve raised the validation share is refused as another run by its own command",
           ("tests/test_checkpoint.py",)),
    Mutant("schema.py", "return self.data.split_seed if self.data.split_seed is not None else self.training.seed",
           "return self.training.seed", "data.split_seed is ignored: the carve moves with training.seed", CARVE),
    Mutant("data.py", "return sum(row in trained for row in text_rows(split))",
           "return len(set(text_rows(split)) & trained)",
           "the start line counts distinct texts also in train, not the validation rows that have one",
           CARVE + ("tests/test_start_of_run.py", "tests/test_test_set.py")),
    Mutant("tasks.py", "return [n / (classes * c) if c else 1.0 for c in counts]",
           "return [c * classes / n if c else 1.0 for c in counts]",
           "class_weights: balanced weighs the common classes up, not the rare ones",
           ("tests/test_problem_types.py", "tests/test_data.py")),
    Mutant("carve.py", "rows = np.sort(np.random.default_rng(seed).choice(len(ds), size=limit, replace=False))",
           "rows = np.arange(limit)", "max_train_samples takes the first rows, not a seeded draw of the split",
           CARVE),
    Mutant("start_line.py",
           'return f"{len(split)} {noun}" + (f" drawn by data.{key}" if cap is not None and len(split) == cap else "")',
           'return f"{len(split)} {noun}"', "the start line counts a capped sample's rows as if they were the file's",
           ("tests/test_start_of_run.py",)),
    Mutant("model_card.py", '+ (" (drawn by `data.max_train_samples`)" if cfg.data.max_train_samples == '
           'train["train_samples"] else ""),', ',',
           "the model card counts a capped sample's rows as if they were the file's", ("tests/test_start_of_run.py",)),
)

# a user's own file read as it was meant: its layout, and each label the class the user wrote (README.md's "Your
# own data", docs/configuration.md's data keys and problem types)
OWN_DATA = ("tests/test_data.py", "tests/test_own_data.py")
DATA_MUTANTS = (
    Mutant("unknown_words.py", "rows.append(np.unique(row_of[is_unknown]) + start)",
           "rows.append(np.unique(row_of[is_unknown]))",
           "the words read as unknown are looked for in the wrong rows past the split's first Arrow chunk",
           ("tests/test_unknown_words.py",)),
    Mutant("unknown_words.py", "row_of = parents if row_of is None else row_of[parents]", "row_of = parents",
           "a chunked text's windows are taken for rows: its unknown words are looked for in other texts",
           ("tests/test_unknown_words.py",)),
    Mutant("unknown_words.py", '        if role != "unk_token":', "        if True:",
           "the unknown token is taken for another special token: no run counts its unknown words",
           ("tests/test_unknown_words.py",)),
    Mutant("unknown_words.py", "tokens += int(ids.size - np.isin(ids, special).sum())",
           "tokens += int(ids.size - np.isin(ids, [*special, unk]).sum())",
           "the unknown tokens are left out of the tokens they are a share of", ("tests/test_unknown_words.py",)),
    Mutant("unknown_words.py", "tokenizer.convert_tokens_to_ids(others) if token != unk})",
           "tokenizer.convert_tokens_to_ids(others)})",
           "a special token missing from the vocabulary takes the unknown tokens out of the count",
           ("tests/test_unknown_words.py",)),
    Mutant("unknown_words.py", "    if unk is None or tokenizer.unk_token in others:", "    if unk is None:",
           "a tokenizer whose unknown token ends every text is said to find an unknown word in each",
           ("tests/test_unknown_words.py",)),
    Mutant("unknown_words.py", "return self.holding > 0 and self.holding >= WORTH_SAYING * self.texts",
           "return self.holding > 0 and self.holding > WORTH_SAYING * self.texts",
           "one text in fifty holding an unknown word goes unsaid", ("tests/test_unknown_words.py",)),
    Mutant("dataloaders.py", "        say_unknown_words(found)", "        pass",
           "a run whose texts the tokenizer cannot read trains without a word of it", ("tests/test_unknown_words.py",)),
    Mutant("workbooks.py", "    if len(kinds) <= 1:\n        return values", "    if True:\n        return values",
           "a workbook's column of texts and numbers is read as typed, which Arrow cannot hold in one column",
           ("tests/test_data.py",)),
    Mutant("workbooks.py", "repeated_columns=repeated_names(header)).keep(rows)", "repeated_columns={}).keep(rows)",
           "a workbook's header row naming the text column twice trains on the first, unsaid", ("tests/test_data.py",)),
    Mutant("workbooks.py", 'unit="row", offset=2,', 'unit="row", offset=1,',
           "a workbook's rows are named one above Excel's numbers", ("tests/test_data.py",)),
    Mutant("data.py", "    if cfg.split_column is None:\n        return _load_local(", "    if True:\n        return _load_local(",
           "data.split_column is ignored: every row of the file trains", ("tests/test_data.py",)),
    Mutant("split_column.py", "    found = _split_like(table, used)", "    found = None",
           "a column of each row's split goes unsaid while its test rows train", ("tests/test_data.py",)),
    Mutant("csv_rows.py", "return as_mask(pc.fill_null(same, False))", "return np.zeros(len(ds), dtype=bool)",
           "a header repeated where files were joined is read as a row, its label a class",
           ("tests/test_data.py",)),
    Mutant("text_encoding.py", "return next((name for mark, name in MARKS if start.startswith(mark)), encoding)",
           "return encoding", "a UTF-16 file with its byte-order mark is refused as not UTF-8",
           ("tests/test_data.py",)),
    Mutant("local_files.py", 'return first[4] if len(first) == 5 and first.startswith("sep=") else None',
           "return None", "Excel's separator line is read as the header", ("tests/test_data.py",)),
    Mutant("labels.py", 'found = found | set(getattr(getattr(feature, "feature", feature), "names", ()))', "pass",
           "data.drop_labels may not name a label column that holds no 1", ("tests/test_problem_types.py",)),
    Mutant("labels.py", "return LabelSpace(names=sorted(present, key=int) if numeric else sorted(present))",
           "return LabelSpace(names=sorted(present))", "integer labels are numbered as text: '10' before '2'",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("labels.py", "return LabelSpace(names=list(dict.fromkeys(label_map.values())))",
           "return LabelSpace(names=sorted(set(label_map.values())))",
           "the classes of data.label_map are numbered alphabetically, not in the map's order", OWN_DATA),
    Mutant("labels.py", "return value.strip() or None", "return value or None",
           "a label typed with a space around it ('spam ') is a class of its own", OWN_DATA),
    Mutant("labels.py", "return str(int(value))", "return str(value)",
           "integer labels read as floats (a column with an empty field) become classes '0.0' and '1.0'",
           OWN_DATA),
    Mutant("labels.py", "return dataclasses.replace(label_space, names=[named[n.casefold()] for n in head])",
           "return label_space",
           "a run from a trained classifier numbers the classes anew, so its outputs change classes",
           OWN_DATA + ("tests/test_cli.py",)),
    Mutant("labels.py", "left_out = np.isin(np.asarray(keys, dtype=object), dropped)",
           "left_out = np.zeros(len(keys), dtype=bool)", "data.drop_labels leaves no row out",
           OWN_DATA + ("tests/test_errors.py",)),
    Mutant("labels.py", "kept = [[key for key in keys if key not in dropped] for keys in sets]",
           "kept = [list(keys) for keys in sets]", "multi_label: data.drop_labels keeps the labels it names",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("labels.py", "return table.keep(np.flatnonzero(~missing))", "return table",
           "data.on_missing_label: drop keeps the rows without a label", OWN_DATA + ("tests/test_errors.py",)),
    Mutant("labels.py", 'return value < 0  # a Hub data set\'s "no label"', "return False",
           "a Hub split's label -1 (no label) is not taken as missing", OWN_DATA),
    Mutant("labels.py", "value = [part.strip() for part in value.split(delimiter)]",
           "value = value.split(delimiter)", "a part of spaces alone ('art| ') is refused as an empty label",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("labels.py", "value = [part for part in value if part]", "value = list(value)",
           "a delimited field ending in its delimiter ('sport|') is refused for an empty label",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("labels.py",
           'sorted(present, key=lambda n: (0, int(n), "") if n.lstrip("-").isdigit() else (1, 0, n)))',
           "sorted(present))", "multi_label: integer labels are numbered as text: '10' before '2'",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("labels.py", "if isinstance(inner, datasets.ClassLabel) else (", "if False else (",
           "multi_label: the labels of a column each are numbered by name, not in the columns' order",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("label_columns.py", "        if wrong is not None:", "        if False:",
           "a column per label: a cell that is no 0 or 1 (2, 0.5, yes) is read as 0",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("label_columns.py", "        missing |= empty", "        pass",
           "a column per label: an empty cell is read as 0, not as a row without labels",
           OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("label_columns.py", 'return values == 1.0, empty, int(wrong[0]) if len(wrong) else None',
           'return values == 0.0, empty, int(wrong[0]) if len(wrong) else None',
           "a column per label: a row's labels are its 0s, not its 1s", OWN_DATA + ("tests/test_problem_types.py",)),
    Mutant("labels.py", "if numbers and strings:", "if False:",
           "a JSON column of labels written as numbers in some rows and words in others reads as twice the classes",
           OWN_DATA + ("tests/test_errors.py",)),
    Mutant("labels.py", "return None if math.isnan(number) else number", "return number",
           "regression: a target of NaN is trained on, not refused as missing",
           OWN_DATA + ("tests/test_problem_types.py", "tests/test_errors.py")),
    Mutant("local_files.py", 'if EXTENSIONS[suffix] == "csv" and tab_separated(path, encoding):', "if False:",
           "a .csv file of tab-separated lines reads as one column", OWN_DATA + ("tests/test_cli.py",)),
    Mutant("local_files.py",
           'if _records_agreeing(path, encoding, ";") <= _records_agreeing(path, encoding, ","):', "if True:",
           "a spreadsheet's semicolon-separated CSV reads as one column", OWN_DATA + ("tests/test_cli.py",)),
    Mutant("csv_rows.py", "    except csv.Error:\n        return None\n",
           "    except csv.Error:\n        return Counter()\n",
           "a TSV file whose quotes are plain characters is read with CSV's, its stray quote running rows together",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "plain is not None and quoted > plain", "quoted > 0",
           "a quoted TSV file with a row of a field too many is read with plain quotes, its error naming another row",
           ("tests/test_data.py",)),
    Mutant("local_files.py", """counts != {0} or _records_agreeing(path, encoding, "\\t", every=True) > 0""",
           "counts != {0}", "a .csv file pandas wrote with tabs, a text over several lines in it, reads as commas",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", """(line.startswith('"') or '\\t"' in line)""", """line.startswith('"')""",
           "a TSV file quoted as CSV quotes, whose texts are not its first column, keeps their quotes doubled",
           ("tests/test_data.py",)),
    Mutant("local_files.py", "rows_from = skip + (header == 0 and names is not None)", "rows_from = skip",
           "a file of R's write.table is refused: its header is checked as a row of the row names' count",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", " or row[0] in seen:", ":",
           "a file whose rows start with one number twice has a column taken for row names and left out",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "or not (row[0].isascii() and row[0].isdigit()) ", "",
           "a file of a stray separator at each row's end reads its texts as row names, its columns shifted",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "                    if not seen:\n                        return None\n", "",
           "a file whose first row has a field too many is refused as R's layout broken, not by its field count",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "                start, end = end + 1, reader.line_num\n",
           "                start = end = reader.line_num\n",
           "a row of two lines that breaks R's layout is named by the line it ends on",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "    while name in names:\n", "    while False:\n",
           "a header that names a column row.names, its rows led by row names, cannot be read",
           ("tests/test_data.py",)),
    Mutant("local_files.py", "    if rows_from > skip:\n", "    if False:\n",
           "R's row names are read as a column of the file's",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "else counts.total() - max(counts.values(), default=0)",
           "else counts.total() - counts[next(iter(counts), 0)]",
           "a quoted TSV file of R's row names, a text with a tab in it, reads its quotes as plain characters",
           ("tests/test_data.py",)),
    Mutant("standard_columns.py", " and len(pc.unique(column)) == len(column))", ")",
           "an unnamed first column of one number twice is said as an index, not warned of",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "if ESCAPED_QUOTE in tail + chunk:", "if False:",
           "a file of R's write.table whose texts hold quotes reads them as ends of texts",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", "out.write(line.replace(ESCAPED_QUOTE, '\"\"'))", "out.write(line)",
           "a file whose quotes are written \\\" is read from a copy that writes them so still",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", " or _parses(\n            path, sep, encoding, unescape=False) or not _parses(",
           " or not _parses(",
           "a CSV file that reads by CSV's rule has its backslashes before quotes read as escapes",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py",
           'if sep == "\\t" and setting == "auto" and tsv_quoting(copy, encoding, skip) != csv.QUOTE_MINIMAL:',
           "if False:",
           "a TSV file of plain quotes has its backslashed quotes read as doubled ones",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", '    if setting != "auto":\n        return QUOTING[setting]\n', "",
           "data.quoting is ignored: a file that never quotes reads its stray quote's lines as one text",
           ("tests/test_data.py",)),
    Mutant("csv_rows.py", 'if setting == "none" or not _holds_escaped_quote(', "if not _holds_escaped_quote(",
           "under data.quoting: none a backslash before a quote is still read as an escape",
           ("tests/test_data.py",)),
    Mutant("local_files.py", 'if starts is not None and fmt == "tsv" and cfg.quoting == "auto":', "if False:",
           "a TSV file's texts read over several lines by CSV's rule are not warned of, nor data.quoting named",
           ("tests/test_data.py",)),
    Mutant("local_files.py", 'and cfg.quoting == "auto":', ":",
           "a TSV file said to be quoted (data.quoting: csv) is warned of its texts over lines all the same",
           ("tests/test_data.py",)),
    Mutant("scored_files.py", 'key not in ("encoding", "quoting", "sheet")', 'key not in ("encoding", "sheet")',
           "finetune score reads a file by its header with its quotes by auto, not as the run's data.quoting says",
           ("tests/test_predict.py",)),
    Mutant("archives.py", "for folder, given in reversed(_GIVEN.items()):", "for folder, given in _GIVEN.items():",
           "an error in an archive's file read from a copy names the unpacked copy, not the archive",
           ("tests/test_archives.py",)),
    Mutant("local_files.py",
           "    text = as_given(text)  # first: a file made from the downloaded copy is named as that copy\n"
           "    if text and is_url(spec) and not in_an_archive(spec):\n        text = text.replace(str(path), spec)\n"
           "    return text\n", "    if text and is_url(spec) and not in_an_archive(spec):\n"
           "        text = text.replace(str(path), spec)\n    return as_given(text)\n",
           "an error in a URL's file read from a copy names the download, not the URL",
           ("tests/test_archives.py",)),
    Mutant("standard_columns.py", "return (pa.types.is_integer(column.type) and ", "return (",
           "an unnamed first column of words is said as an index, not warned of",
           ("tests/test_data.py",)),
    Mutant("standard_columns.py", "if unnamed[:1] == [table.ds.column_names[0]] and ", "if unnamed and ",
           "an unnamed column of numbers after the named ones is said as an index, not warned of",
           ("tests/test_data.py",)),
)

# what a run writes is what README.md's table says, and a file the user wrote is never replaced (README.md's "What a
# run writes", docs/inference.md's scores)
SCORING = ("tests/test_predict.py", "tests/test_metrics.py")
OUTPUT_MUTANTS = (
    Mutant("results.py", "    if same_run and (out / MODEL_CARD_FILE).is_file():", "    if False:",
           "a finished run's command run again drops the files finetune score --card added to its card",
           ("tests/test_predict.py",)),
    Mutant("fitting.py", "write_outputs(run, summary, same_run=checkpoints.resume_path is not None)",
           "write_outputs(run, summary, same_run=True)",
           "a new run in the folder (output.overwrite) keeps the old model's scored files in its card",
           ("tests/test_predict.py",)),
    Mutant("model_card.py", "    if data.text_pair_column is None:", "    if True:",
           "the card of a model trained on pairs shows its pipeline called with one text", ("tests/test_model_card.py",)),
    Mutant("model_card.py", '"multi_label": f"classifier({text}, top_k=None)', '"multi_label": f"classifier({text}',
           "the card of a multi-label model shows a pipeline call that returns its most probable label alone",
           ("tests/test_model_card.py",)),
    Mutant("results.py", 'round(train["samples"] / seconds, 3) if seconds > 0 else None,',
           'round(train["updates"] / seconds, 3) if seconds > 0 else None,',
           "all_results.json's train_samples_per_second counts updates", ("tests/test_selection.py",)),
    Mutant("launch.py", '    if num_processes == 1:\n        return ["finetune", "train"]',
           '    if True:\n        return ["finetune", "train"]',
           "the card's command trains a run of several processes again on one",
           ("tests/test_model_card.py", "tests/test_selection.py")),
    Mutant("model_card.py", 'f"output.output_dir={output_dir}-again"', 'f"output.output_dir={output_dir}"',
           "the card's command trains again into the run's own folder, not a new one",
           ("tests/test_model_card.py", "tests/test_selection.py")),
    Mutant("results.py",
           'if path.exists() and MODEL_CARD_MARK not in path.read_text(encoding="utf-8", errors="replace"):',
           "if False:", "a README.md the user wrote in the output folder is replaced by the model card",
           ("tests/test_selection.py", "tests/test_model_card.py")),
    Mutant("results.py", "if not (folder / ADAPTER_CONFIG).is_file():", "if False:",
           "a folder named adapter/ that finetune did not write is deleted by a LoRA run's save",
           ("tests/test_lora.py",)),
    Mutant("modeling.py", "config.id2label = dict(id2label)", "config.id2label = {i: f'LABEL_{i}' for i in id2label}",
           "the saved model names its classes LABEL_0, LABEL_1, not as the data does",
           ("tests/test_predict.py", "tests/test_own_data.py")),
    Mutant("metrics/intervals.py",
           "return np.bincount(ref * num_labels + pred,", "return np.bincount(pred * num_labels + ref,",
           "the confusion matrix's rows are the predicted classes, not the true ones", SCORING),
    Mutant("comparison.py", "differences = {name: this.metrics[name] - value for name, value in metrics.items()}",
           "differences = {name: value - this.metrics[name] for name, value in metrics.items()}",
           "finetune score --against gives the other run's score less this one's", SCORING),
    Mutant("comparison.py",
           "others = in_this_runs_labels(task.predictions(logits).numpy(), predictor.labels, this.labels, kind)",
           "others = task.predictions(logits).numpy()",
           "--against compares another run's classes by number, not by name, where the two number them otherwise",
           SCORING),
)

# a run's tracker runs are named for it and a resumed run goes on with them, each update once (docs/logging.md)
TRACKERS = ("tests/test_trackers.py",)
TRACKER_MUTANTS = (
    Mutant("tracker_runs.py", '"wandb": Naming(named=lambda name: {"name": name}',
           '"wandb": Naming(named=lambda name: {}', "a W&B run is not named for its output folder", TRACKERS),
    Mutant("tracker_runs.py", '"mlflow": Naming(named=lambda name: {"run_name": name}',
           '"mlflow": Naming(named=lambda name: {}', "an MLflow run is not named for its output folder", TRACKERS),
    Mutant("tracker_runs.py", 'continued=lambda run_id: {"id": run_id, "resume": "allow"},',
           "continued=lambda run_id: {},", "a resumed run starts a new W&B run", TRACKERS),
    Mutant("tracker_runs.py", 'continued=lambda run_id: {"run_id": run_id},', "continued=lambda run_id: {},",
           "a resumed run starts a new MLflow run", TRACKERS),
    Mutant("tracker_runs.py", "if step is not None and step <= self.through:", "if False:",
           "a continued W&B run is sent again the updates its server holds", TRACKERS),
    Mutant("tracker_runs.py", "return {k: v for k, v in scalars(record).items() if (k, step) not in self.pairs}",
           "return scalars(record)", "a continued MLflow run is sent again the updates it holds", TRACKERS),
    Mutant("tracker_runs.py", "there = CONTINUATION[tracker].still_there(run_id)", "there = True",
           "a resumed run tries to go on with an MLflow run that was deleted, and fails", TRACKERS),
    Mutant("tracker_runs.py",
           '"wandb": Naming(named=lambda name: {"name": name}, '
           'grouped=lambda group: {"group": group})',
           '"wandb": Naming(named=lambda name: {"name": name}, '
           'grouped=lambda group: {})',
           "logging.run_group does not reach W&B", TRACKERS),
)

# one run config on any number of processes: the same updates, each process its share of the machine, one log
# (docs/scaling.md)
LAUNCH = ("tests/test_scaling.py",)
IDLE = ("tests/test_start_of_run.py",)
SCALING_MUTANTS = (
    Mutant("accumulation.py", "if B % (b * num_processes) != 0:", "if B % b != 0:",
           "an effective batch the processes cannot split is let through", LAUNCH + ("tests/test_auto_batch.py",)),
    Mutant("accumulation.py", "if k is not None and k != derived:", "if False:",
           "gradient_accumulation_steps contradicting effective_batch_size is let through", LAUNCH),
    Mutant("launch.py", "return cores // processes_on_this_machine(num_processes)", "return cores",
           "each CPU process of a launch takes every core, not its share",
           LAUNCH + ("tests/test_container_limits.py", "tests/test_tokenize_processes.py")),
    Mutant("launch.py",
           'return _processes_in("LOCAL_WORLD_SIZE") if os.environ.get("LOCAL_WORLD_SIZE") else max(1, num_processes)',
           "return max(1, num_processes)",
           "processes on several machines share out one machine's cores and RAM as if all were on it",
           LAUNCH + ("tests/test_memory_plan.py", "tests/test_container_limits.py")),
    Mutant("launch.py", "if state.num_processes != world:", "if False:",
           "a launch whose processes did not all join trains anyway", LAUNCH),
    Mutant("launch.py", 'if engine == "DeepSpeed" and state.device.type == "cpu":', "if False:",
           "DeepSpeed asked for on the CPU fails deep in Accelerate's set-up, not in one line", LAUNCH),
    Mutant("launch.py", 'if engine and state.is_main_process and state.device.type == "cpu":', "if False:",
           "FSDP asked for on the CPU runs plain DDP without a word", LAUNCH),
    Mutant("tracking.py", "        if self.accelerator.is_main_process:\n            with open(self.path",
           "        if True:\n            with open(self.path",
           "every process writes the log's records, so each update is there once per process", LAUNCH),
    # the cautions of GPUs a run leaves unused (finetune/placement.py), and the launch one names
    Mutant("launch.py", 'if device.type != "cuda" or processes_on_this_machine(num_processes) != num_processes:',
           'if device.type != "cuda":', "each machine of a launch over several is told to launch its GPUs alone",
           IDLE),
    Mutant("placement.py", "processes = max(p for p in range(1, gpus + 1) if B % p == 0)", "processes = gpus",
           "the caution names a launch over processes that cannot split the effective batch, which is refused",
           IDLE),
    Mutant("placement.py", "    if training.effective_batch_size is None:  # k given", "    if False:  # k given",
           "a run of a given k is told a launch whose updates are as many times larger as its processes", IDLE),
    Mutant("placement.py", "(B // processes) % b:", "B % b:",
           "the launch named keeps a micro-batch each process's share of an update cannot hold, which is refused",
           IDLE),
    Mutant("machine.py", "return sum(1 for entry in listed.iterdir() if entry.is_dir())",
           "return sum(1 for entry in listed.iterdir())", "a file in the NVIDIA driver's folder is counted as a GPU",
           IDLE),
    Mutant("gpu_reach.py", "    if torch.version.cuda is None:", "    if False:",
           "a CPU build of torch is told as one built for a CUDA the driver cannot run", IDLE),
    Mutant("gpu_reach.py", "    if not torch.cuda.is_available():", "    if True:",
           "a run put on the CPU while torch reaches the GPUs is told torch cannot reach them", IDLE),
    Mutant("gpu_reach.py", 'if device.type != "cpu" or gpus_hidden_on_purpose():',
           "if gpus_hidden_on_purpose():", "a run on a GPU is told torch cannot reach the machine's GPUs", IDLE),
    Mutant("gpu_reach.py", 'hidden.strip() in ("", "-1")', 'hidden.strip() == ""',
           "GPUs hidden with CUDA_VISIBLE_DEVICES=-1 are cautioned of as out of torch's reach", IDLE),
    Mutant("gpu_reach.py", 'in ("1", "true", "yes")', 'in ("1", "yes")',
           "a run that accelerate launch --cpu put on the CPU is cautioned of the GPUs it leaves", IDLE),
    Mutant("ensemble.py", '    if options.get("device") is None:\n        doing = ', "    if False:\n        doing = ",
           "a model predicting a large file on the CPU beside GPUs torch cannot reach says nothing of why", ENSEMBLE),
    Mutant("comparison.py", "across_processes=across_processes, notes=False)",
           "across_processes=across_processes)",
           "a score against another run says twice why the models run on the CPU beside the GPUs", ENSEMBLE),
    Mutant("sweep_notes.py", "        if kind in self.said:\n            return False",
           "        if False:\n            return False",
           "a sweep says the cautions of the GPUs a trial leaves unused again for every trial", IDLE),
)

# no run deletes work it was not told to: what output.overwrite clears, what pruning removes, the folder's lock
# (docs/checkpoints.md)
KEEPS = RESUME + ("tests/test_lora.py",)
KEEPING_MUTANTS = (
    Mutant("outputs.py",
           'if child.is_dir() and match and (match.group(1) or (child / "trainer_state.json").is_file()):',
           "if child.is_dir():", "output.overwrite deletes every folder in checkpoints/, the user's too", KEEPS),
    Mutant("outputs.py", "if (adapter / ADAPTER_CONFIG).is_file():", "if adapter.is_dir():",
           "output.overwrite deletes a folder named adapter/ that finetune did not write", KEEPS),
    Mutant("outputs.py", "for path in (out / LOG_FILE, out / METRICS_FILE, out / RESULTS_FILE, out / CURVES_FILE):",
           "for path in (out / LOG_FILE, out / METRICS_FILE, out / RESULTS_FILE, out / CURVES_FILE, out / "
           '"README.md"):', "output.overwrite deletes a README.md the user wrote in the folder",
           KEEPS + ("tests/test_selection.py",)),
    Mutant("checkpoint_files.py", "if child.is_dir() and child.name.startswith((TMP_PREFIX, OLD_PREFIX)):",
           "if child.is_dir() and not child.name.startswith(CHECKPOINT_PREFIX):",
           "pruning deletes every folder in checkpoints/ that is not a checkpoint, the user's too", KEEPS),
    Mutant("checkpoint_files.py", "for path in others[: max(0, len(others) - max(0, keep_last - len(kept)))]:",
           "for path in others[: max(0, len(others) - keep_last)]:",
           "output.keep_last keeps one checkpoint too many or too few where the best is kept besides", KEEPS),
    Mutant("outputs.py", "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
           "a second run writes into the folder a live run holds", KEEPS),
)

# a dry run says how long the run would take, and what it would evaluate and save, without writing
# (docs/configuration.md's "A dry run")
DRY_RUN = ("tests/test_dry_run.py",)
DRY_RUN_MUTANTS = (
    Mutant("checkpointer.py", "protected = 2 if self.history.selection is not None else 1", "protected = 1",
           "a sweep's dry run counts the disk of a run's checkpoints without the best one, which pruning keeps",
           DRY_RUN),
    Mutant("sweep_dry_run.py", "    if need <= free:", "    if True:",
           "a sweep that would fill the disk is said as a note, not warned of", DRY_RUN),
    Mutant("rehearsal.py", "pace = statistics.median(seconds[len(seconds) // 2:])", "pace = statistics.median(seconds)",
           "the dry run's pace takes in its first updates, which compile and warm up", DRY_RUN),
    Mutant("rehearsal.py", "return pace, sum(seconds[:updates]) + pace * max(0, updates - len(seconds))",
           "return pace, pace * updates", "the estimate leaves out the first updates' own time", DRY_RUN),
    Mutant("rehearsal.py",
           'done = checkpoints.resume_meta["state"]["step"] if checkpoints.resume_meta is not None else 0',
           "done = 0", "a dry run of a stopped run estimates the whole run, not what is left of it", DRY_RUN),
    Mutant("rehearsal.py", "return first + again * (whole - timed) / timed, len(rows), ends[1] - began",
           "return first, len(rows), ends[1] - began",
           "a large validation set's evaluation is timed on its sample alone", DRY_RUN),
    Mutant("fitting.py", "return count + self.validating  # fit evaluates the final weights, due or not",
           "return count", "the dry run leaves out the evaluation of the final weights", DRY_RUN),
    Mutant("checkpointer.py",
           "or bool(self.every and step % self.every == 0) for step, micro_batch, k, ends in updates)",
           "for step, micro_batch, k, ends in updates)",
           "the dry run leaves out the checkpoints of output.checkpoint_every", DRY_RUN),
    Mutant("checkpointer.py", "return sum(ends or (selecting and due.mid_epoch(step, micro_batch, k))",
           "return sum(ends or (False and due.mid_epoch(step, micro_batch, k))",
           "the dry run leaves out the checkpoint after each evaluation inside an epoch under a selection", DRY_RUN),
)

# the CPU speed-ups change how a micro-batch is computed, never its update (docs/performance.md)
SPEEDUPS = ("tests/test_sparse_embedding.py", "tests/test_dropout.py")
CPU_MUTANTS = (
    Mutant("cpu/sparse_embedding.py", "        buf.zero_()", "        pass",
           "the embedding's dense buffer keeps the last update's gradient", SPEEDUPS),
    Mutant("cpu/sparse_embedding.py",
           "if sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight) != 1:",
           "if False:", "an embedding tied to another module gets a sparse gradient beside the dense one", SPEEDUPS),
    Mutant("cpu/dropout.py", "return mask, _LEVELS / (_LEVELS - threshold)", "return mask, 1 / (1 - p)",
           "fast dropout scales by the probability asked for, not the one its masks keep with", SPEEDUPS),
    Mutant("cpu/dropout.py", "return grad.mul(mask).mul_(ctx.scale), None, None", "return grad * ctx.scale, None, None",
           "fast dropout's backward lets the gradient through the dropped elements", SPEEDUPS),
    Mutant("cpu/dropout.py", "    if not training or p == 0.0:", "    if p == 0.0:",
           "fast dropout drops in evaluation too", SPEEDUPS),
    Mutant("cpu/dropout.py", "grad_dropped = torch.matmul(grad, v.transpose(-1, -2)).mul_(keep).mul_(ctx.scale)",
           "grad_dropped = torch.matmul(grad, v.transpose(-1, -2)).mul_(ctx.scale)",
           "the written-out attention's backward lets the gradient through dropped probabilities", SPEEDUPS),
    Mutant("cpu/dropout.py", "out = torch.matmul(probs.mul(keep).mul_(scale), v)",
           "out = torch.matmul(probs.mul(keep), v)",
           "the written-out attention's dropout is not rescaled", SPEEDUPS),
)

# the GPU levers change the kernels of an update, not its sums: each is checked on the CPU too (docs/performance.md)
GPU_LEVERS = ("tests/test_bias_apart.py", "tests/test_accumulation_fusion.py")
GPU_LEVER_MUTANTS = (
    Mutant("bias_apart.py", "return product + self.bias.to(product.dtype)", "return product",
           "bias_apart drops the bias", GPU_LEVERS),
    Mutant("bias_apart.py", "if type(module) is torch.nn.Linear and module.bias is not None:",
           "if isinstance(module, torch.nn.Linear) and module.bias is not None:",
           "bias_apart swaps the class of a layer derived from nn.Linear, whose own forward it then skips",
           GPU_LEVERS),
    Mutant("accumulation_fusion.py",
           "grad_bias = rows.sum(0, dtype=torch.float32) if ctx.has_bias and needs_bias else None",
           "grad_bias = rows.sum(0) if ctx.has_bias and needs_bias else None",
           "the fused layer's bias gradient is summed in bf16, not fp32", GPU_LEVERS),
    Mutant("accumulation_fusion.py", "    grad.addmm_(grad_output.t().to(grad.dtype), input.to(grad.dtype))",
           "    grad.copy_(torch.mm(grad_output.t(), input).to(grad.dtype))",
           "the fused layer's low-precision product replaces the window's gradient instead of adding to it",
           GPU_LEVERS),
    Mutant("accumulation_fusion.py", "grad_x = grad_out.to(weight_cast.dtype) @ weight_cast if needs_x else None",
           "grad_x = grad_out.to(weight_cast.dtype) @ weight_cast.t() if needs_x and False else None",
           "the fused layer passes no gradient to its input, so the layers below it stop learning", GPU_LEVERS),
    Mutant("accumulation_fusion.py", "            self.weight.grad = torch.zeros_like(self.weight)",
           "            self.weight.grad = torch.ones_like(self.weight)",
           "a window after the gradients were freed starts its sum from ones, not zeros", GPU_LEVERS),
    Mutant("loop.py", "        return graphs.loss_fn\n",
           "        return loss_fn or Task.of_model(accelerator.unwrap_model(model)).per_sample_loss\n",
           "a micro-batch the CUDA graphs do not take trains on the plain loss, the replayed ones on the config's",
           ("tests/test_cuda_graphs.py",)),
)

RULES = {"accumulation": ACCUMULATION_MUTANTS, "resume": RESUME_MUTANTS, "input": INPUT_MUTANTS,
         "scores": SCORE_MUTANTS, "memory": MEMORY_MUTANTS, "sweep": SWEEP_MUTANTS, "long_texts": LONG_TEXT_MUTANTS,
         "inference": INFERENCE_MUTANTS, "logging": LOGGING_MUTANTS, "evaluation": EVALUATION_MUTANTS,
         "data": DATA_MUTANTS, "outputs": OUTPUT_MUTANTS,
         "trackers": TRACKER_MUTANTS, "scaling": SCALING_MUTANTS,
         "keeping": KEEPING_MUTANTS, "dry_run": DRY_RUN_MUTANTS,
         "cpu": CPU_MUTANTS, "gpu_levers": GPU_LEVER_MUTANTS}
MUTANTS = (ACCUMULATION_MUTANTS + RESUME_MUTANTS + INPUT_MUTANTS + SCORE_MUTANTS + MEMORY_MUTANTS + SWEEP_MUTANTS
           + LONG_TEXT_MUTANTS + INFERENCE_MUTANTS + LOGGING_MUTANTS + EVALUATION_MUTANTS
           + DATA_MUTANTS + OUTPUT_MUTANTS + TRACKER_MUTANTS + SCALING_MUTANTS
           + KEEPING_MUTANTS + DRY_RUN_MUTANTS + CPU_MUTANTS
           + GPU_LEVER_MUTANTS)


def source_of(mutant: Mutant, root: Path = REPO) -> str:
    """The module's text, checked to hold the mutant's line exactly once.

    Raises:
        ValueError: if it does not: the code moved, and the mutant must follow it.
    """
    text = (root / "finetune" / mutant.module).read_text(encoding="utf-8")
    if text.count(mutant.line) != 1:
        raise ValueError(f"finetune/{mutant.module}: {mutant.line.strip()[:60]!r} occurs {text.count(mutant.line)} "
                         f"times, not once: update the mutant ({mutant.rule})")
    return text


def scratch_copy(into: Path) -> Path:
    """The checkout's tracked files (as they are in the working tree), copied into ``into``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def killed(mutant: Mutant, copy: Path) -> tuple[bool, str]:
    """Run the mutant's tests on the scratch copy with its line replaced; ``(whether they failed, pytest's
    summary line)``. The line is put back afterwards."""
    path = copy / "finetune" / mutant.module
    text = source_of(mutant, copy)
    path.write_text(text.replace(mutant.line, mutant.bug), encoding="utf-8")
    try:
        # the copy's package comes first on the path: an editable install would otherwise import the checkout's
        env = {**os.environ, "PYTHONPATH": str(copy)}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "2", "-m", "not gpu",
                                 "-p", "no:warnings", "-p", "no:cacheprovider", *mutant.tests],
                                cwd=copy, env=env, capture_output=True, text=True)
    finally:
        path.write_text(text, encoding="utf-8")
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return result.returncode != 0, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutant numbers (see --list)")
    parser.add_argument("--rules", help=f"the mutants of some promises' rules, comma-separated: {', '.join(RULES)}")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    args = parser.parse_args(argv)
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(MUTANTS))
    unknown = [i for i in chosen if not 0 <= i < len(MUTANTS)]
    if unknown:
        parser.error(f"--only: no mutant {unknown[0]} (there are {len(MUTANTS)}, numbered from 0: --list)")
    if args.rules:
        sets = args.rules.split(",")
        strange = [name for name in sets if name not in RULES]
        if strange:
            parser.error(f"--rules: no set {strange[0]!r} (the sets: {', '.join(RULES)})")
        chosen = [i for i in chosen if any(MUTANTS[i] in RULES[name] for name in sets)]
    if args.list:
        for i in chosen:
            mutant = MUTANTS[i]
            print(f"{i:2d} finetune/{mutant.module}: {mutant.rule} ({', '.join(mutant.tests)})")
        return 0
    survivors = 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        copy = scratch_copy(Path(scratch))
        for i in chosen:
            mutant = MUTANTS[i]
            caught, summary = killed(mutant, copy)
            survivors += not caught
            print(f"{'KILLED  ' if caught else 'SURVIVED'} {i:2d} finetune/{mutant.module}: {mutant.rule} | {summary}",
                  flush=True)
    print(f"{len(chosen) - survivors} of {len(chosen)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
