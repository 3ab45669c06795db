"""Probes behind the README's explanations: where the time goes, what masks cost, how RSS moves.

Each prints a Markdown table (and writes ``bench/results/probe_<name>.json``);
none is a comparison with the Trainer, which is ``bench/run.py``'s job::

    python -m bench.probe masks      # dropout mask generators and one attention's time (seconds)
    python -m bench.probe profile    # where 12 updates of the SMS job spend their wall time, by op (about 1 minute)
    python -m bench.probe rss        # RSS around every forward, backward and update: BBC News (8, 4) and (8, 1)
    python -m bench.probe device     # on a GPU: how busy the GPU is over updates of the BBC News job, eager and graphed
    python -m bench.probe packing    # forward and backward of SMS windows cut equally, balanced, or packed
    python -m bench.probe heap       # training.cpu_heap keep against trim, paired rounds, page faults per update
    python -m bench.probe casts      # training.cast_once_per_update on against off: ops, kernels, ms per micro-batch

``profile``, ``rss``, ``device``, ``heap`` and ``casts`` take dotted overrides after the name (for example
``training.fast_dropout_masks=false``), applied to the job's config. Like the
benchmark, every probe uses 2 torch threads unless ``--threads N`` comes first.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import REPO, ArmSpec, job_config, set_threads, write_result  # noqa: E402

RESULTS = REPO / "bench" / "results"

# Groups of the profile's ops, by aten name.
GROUPS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    # autocast's casts of the weights (and, in the backward pass, of their gradients back to fp32)
    "dtype casts": ("aten::_to_copy",),
    "dropout masks": ("aten::bernoulli_", "aten::random_", "aten::uniform_"),
    "optimizer step": ("aten::_fused_adamw_", "aten::_foreach_", "aten::lerp_", "aten::addcdiv_", "aten::addcmul_"),
}


def masks(threads: int, repeats: int = 30) -> dict[str, Any]:
    """Nanoseconds per element of each way to draw a dropout mask of one MiniLM attention map (8, 12, 64, 64)."""
    import numpy as np
    import torch

    from bench.levers import _alternating
    from finetune.cpu.dropout import drop, keep_mask

    set_threads(threads)
    shape = (8, 12, 64, 64)
    n = 8 * 12 * 64 * 64
    x = torch.randn(shape)
    rng = np.random.Generator(np.random.SFC64(0))
    fns = {
        "torch bernoulli_ (torch's CPU dropout mask)": lambda: torch.empty(shape).bernoulli_(0.9),
        "torch.nn.functional.dropout (mask and scaling)": lambda: torch.nn.functional.dropout(x, 0.1, True),
        "torch.rand < p": lambda: torch.rand(shape) < 0.9,
        "finetune.cpu.dropout.keep_mask (16-bit words)": lambda: keep_mask(shape, 0.1),
        "finetune.cpu.dropout.drop (mask and scaling)": lambda: drop(x, 0.1),
        "numpy SFC64 random + compare (reference)": lambda: rng.random(n, dtype=np.float32) < 0.9,
    }
    seconds = _alternating(fns, repeats=repeats, warmup=2)
    return {"shape": list(shape), "threads": threads, "ns_per_element": {k: v / n * 1e9 for k, v in seconds.items()},
            "attention_ms": attention(repeats)}


def attention(repeats: int, length: int = 32) -> dict[str, float]:
    """Milliseconds of one MiniLM attention's forward and backward (b=8, 12 heads of 32, ``length`` tokens).

    q, k and v are head views of (b, L, 384) projections, as BERT hands them
    over, and the output goes back to that layout, so every variant pays the
    same layout changes the model would.
    """
    import torch
    import torch.nn.functional as F

    from bench.levers import _alternating
    from finetune.cpu.dropout import _Attention, keep_mask

    b, h, d = 8, 12, 32
    q, k, v = (torch.randn(b, length, h, d).transpose(1, 2).requires_grad_() for _ in range(3))
    keep = torch.ones(b, 1, length, length, dtype=torch.bool)
    keep[: b // 2, :, :, length // 2 :] = False  # half the sequences padded to twice their length
    grad = torch.randn(b, length, h, d)

    def sdpa(p):
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p).transpose(1, 2) \
            .contiguous().backward(grad)

    def autograd_formula():
        scores = torch.matmul(q, k.transpose(-1, -2)).mul(d**-0.5).masked_fill(~keep, torch.finfo(q.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        mask, scale = keep_mask(probs.shape, 0.1)
        torch.matmul(probs * mask * scale, v).transpose(1, 2).contiguous().backward(grad)

    fns = {
        "SDPA, no dropout (fused kernel)": sdpa(0.0),
        "SDPA, dropout 0.1 (torch's masks, unfused)": sdpa(0.1),
        "16-bit masks, autograd over the formula": autograd_formula,
        "16-bit masks, finetune.cpu.dropout's backward": lambda: _Attention.apply(q, k, v, keep, d**-0.5, 0.1)
        .transpose(1, 2).contiguous().backward(grad),
    }
    return {name: t * 1e3 for name, t in _alternating(fns, repeats=repeats * 3, warmup=3).items()}


def _setup(overrides: list[str], dataset: str, b: int, k: int, updates: int, threads: int,
           blocking_copies: bool = False):
    """The job's config and its :func:`~finetune.assembly.setup_run`; ``blocking_copies`` builds it with
    Accelerate's default of copying each batch to the device synchronously instead of the package's
    asynchronous copies."""
    os.environ["FINETUNE_CPU_THREADS"] = str(threads)
    from finetune.assembly import setup_run
    from finetune.launch import build_accelerator

    # eager micro-batches, dynamically padded: the probes time train_one_epoch's own steps, without graphs
    cfg = job_config(ArmSpec("ours", dataset, b, k, max_steps=updates),
                     ["logging.progress_bar=false", "training.cuda_graphs=false"] + overrides)
    accelerator = build_accelerator(cfg)
    accelerator.dataloader_config.non_blocking = not blocking_copies  # read when the loaders are prepared
    return cfg, setup_run(cfg, accelerator)


def _train(cfg, run, until: int, **kw):
    from finetune.cpu import cpu_speedups, speedup_settings
    from finetune.loop import train_one_epoch

    with cpu_speedups(run.model, run.optimizer, run.accelerator, **speedup_settings(cfg.training)):
        return train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, run.accelerator, 0,
                               state=run.state, max_grad_norm=cfg.training.max_grad_norm, max_updates=until, **kw)


def profile(threads: int, overrides: list[str], updates: int = 12, warmup: int = 3) -> dict[str, Any]:
    """Where the time of ``updates`` updates of the SMS job goes (after ``warmup`` updates), by op and group.

    :class:`OpClock` times every aten op as it is dispatched, backward ops
    included, over ``updates`` updates; the next ``updates`` run without it,
    for the plain time per update. Shares are of the time inside ops. Timed,
    the ops run a little slower than plain (the clock's Python between them
    evicts caches), so their sum can exceed the plain time, and what they
    leave out (Python, the autograd engine, data loading) cannot be measured
    this way. torch.profiler is not used for the shares: its event buffers
    change how the C heap is reused, and on the CPU it made the casts of the
    feed-forward weights fault their pages in on every call, inflating them
    several times (to about a third of the profiled time).
    """
    if TorchDispatchMode is None:
        raise SystemExit("`profile` needs torch.utils._python_dispatch.TorchDispatchMode, which this torch lacks")
    cfg, run = _setup(overrides, "sms", 8, 4, warmup + 2 * updates, threads)
    clock = OpClock()
    with clock:  # the warm-up's shapes count as seen
        _train(cfg, run, warmup)
    clock.restart()
    started = time.perf_counter()
    with clock:
        _train(cfg, run, warmup + updates)
    timed = (time.perf_counter() - started) / updates
    started = time.perf_counter()
    _train(cfg, run, warmup + 2 * updates)
    plain = (time.perf_counter() - started) / updates
    ops = {op: (calls / updates, seconds / updates) for op, (calls, seconds) in clock.ops.items()}
    in_ops = sum(s for _, s in ops.values())
    groups = {name: sum(s for op, (_, s) in ops.items() if op.startswith(prefixes)) / in_ops
              for name, prefixes in GROUPS.items()}
    groups["other ops"] = 1 - sum(groups.values())
    members = {name: {op: round(c) for op, (c, _) in ops.items() if op.startswith(prefixes)}
               for name, prefixes in GROUPS.items()}
    top = sorted(ops.items(), key=lambda item: -item[1][1])[:15]
    return {"updates": updates, "overrides": overrides, "threads": threads,
            "wall_s_per_update": plain, "timed_wall_s_per_update": timed, "op_s_per_update": in_ops,
            "groups": groups, "group_calls": members,
            "new_shape_matmuls": {"calls_per_update": clock.new_shape_calls / updates,
                                  "share": clock.new_shape_seconds / updates / in_ops},
            "top": [{"op": op, "share": s / in_ops, "calls_per_update": c, "ms_per_call": 1e3 * s / c}
                    for op, (c, s) in top]}


try:  # OpClock's base lives in a private torch module: only `profile` needs it, and says so if it is gone
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:
    TorchDispatchMode = None


class OpClock(TorchDispatchMode or object):
    """Times every aten op as it is dispatched, below autograd: the forward's and the backward's ops alike.

    Each op is timed as a whole (the ops it calls in turn are not seen), so
    the times add up without double counting. Matrix products are also
    counted at shapes not seen before, where oneDNN builds a kernel first.
    """

    def __init__(self):
        super().__init__()
        self.shapes: set = set()
        self.restart()

    def restart(self) -> None:
        """Forget the times and counts so far; the shapes seen stay seen."""
        self.ops: dict[str, list] = {}
        self.new_shape_calls = 0
        self.new_shape_seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - started
        op = func.name().split(".")[0]
        record = self.ops.setdefault(op, [0, 0.0])
        record[0] += 1
        record[1] += seconds
        if op in GROUPS["matrix products"]:
            shape = (op,) + tuple((tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor))
            if shape not in self.shapes:
                self.shapes.add(shape)
                self.new_shape_calls += 1
                self.new_shape_seconds += seconds
        return out


def _train_updates(cfg, run, until: int, **kw) -> None:
    """Train until ``run.state.step`` reaches ``until``, epoch after epoch."""
    while run.state.step < until:
        _train_epoch_of(cfg, run, until, **kw)


def _train_epoch_of(cfg, run, until: int, **kw):
    from finetune.loop import train_one_epoch

    return train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, run.accelerator,
                           run.state.epoch, state=run.state, max_grad_norm=cfg.training.max_grad_norm,
                           max_updates=until, **kw)


def device(threads: int, overrides: list[str], updates: int = 10, warmup: int = 10, rounds: int = 2) -> dict[str, Any]:
    """Wall time against GPU kernel time over ``updates`` updates of the BBC News job (after ``warmup``), in
    alternating rounds of four ways: eager steps; eager steps with each micro-batch copied to the GPU
    synchronously (Accelerate's default); and on a GPU, micro-batches replayed from CUDA graphs
    (``training.cuda_graphs``), also with each encoder block compiled (``training.torch_compile: blocks``, the
    fastest update measured). Each way's waits for the GPU per update (``torch.cuda.set_sync_debug_mode``),
    and the kernels and host ops of the eager and the graphed ways, profiled.

    If the kernels' summed time is well under the wall time, the GPU waits for
    the host (Python, kernel launches, collation): the answer is fewer, larger
    kernels (CUDA graphs, compile) or more work per kernel (a larger
    micro-batch), and no wait per micro-batch, during which the host cannot
    queue the next one's kernels. What is left of that gap with graphs is what
    they do not capture: the update, the copies, the loop's bookkeeping.
    """
    import torch

    from finetune.cuda_graphs import graphs_for_run

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    total = warmup + (rounds + 4) * updates
    # each way: blocking copies, replayed from graphs, and what it compiles
    ways = {"eager": (False, False, []), "eager, blocking copies": (True, False, [])}
    if gpu:
        ways["graphed"] = (False, True, [])
        ways["graphed, compiled blocks"] = (False, True, ["training.torch_compile=blocks"])
    setups = {}
    for name, (blocking, graphed, compiled) in ways.items():
        cfg, run = _setup(overrides + compiled + (["training.cuda_graphs=true"] if graphed else []), "bbc", 8, 4,
                          total, threads, blocking_copies=blocking)
        setups[name] = (cfg, run, {"graphs": graphs_for_run(run)} if graphed else {})
    for cfg, run, kw in setups.values():
        _train_updates(cfg, run, warmup, **kw)
    walls: dict[str, list[float]] = {name: [] for name in setups}
    for r in range(rounds):
        for name, (cfg, run, kw) in (list(setups.items())[::-1] if r % 2 else setups.items()):
            sync()
            started = time.perf_counter()
            _train_updates(cfg, run, run.state.step + updates, **kw)
            sync()
            walls[name].append(time.perf_counter() - started)
    waits = {name: _waits_per_update(cfg, run, updates, **kw) for name, (cfg, run, kw) in setups.items()}
    profiled = {name: _profile_updates(*setups[name], updates, sync) for name in setups
                if name != "eager, blocking copies"}
    samples = setups["eager"][1].batching.effective_batch_size
    return {"updates": updates, "rounds": rounds, "overrides": overrides,
            "device": torch.cuda.get_device_name() if gpu else "CPU",
            "effective_batch_size": samples,
            "micro_batches_per_update": setups["eager"][1].batching.gradient_accumulation_steps,
            "ways": {name: {"wall_s_per_update": [w / updates for w in walls[name]],
                            "samples_per_s": samples * updates / statistics.median(walls[name]),
                            "waits_per_update": waits[name], **profiled.get(name, {})} for name in setups},
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if gpu else float("nan")}


def _profile_updates(cfg, run, kw: dict, updates: int, sync) -> dict[str, Any]:
    """The GPU kernels (summed time per update, the top 15) and the host's ops (self time, the top 15) of
    ``updates`` more updates."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        _train_updates(cfg, run, run.state.step + updates, **kw)
        sync()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us() / 1e6)
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    cpu = sorted(((e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()), key=lambda e: -e[1])
    return {"kernel_s_per_update": sum(sum(v) for v in kernels.values()) / updates,
            "kernels": [{"kernel": k[:90], "s_per_update": sum(v) / updates, "calls_per_update": len(v) / updates}
                        for k, v in top],
            "cpu_ops": [{"op": k, "s_per_update": t / updates, "calls_per_update": c / updates}
                        for k, t, c in cpu[:15]]}


def _waits_per_update(cfg, run, updates: int, **kw) -> Optional[dict[str, float]]:
    """How often the host waits for the GPU per update over ``updates`` updates, in the model's code
    (transformers) and outside it (``None`` without a GPU)."""
    import torch

    from bench.common import host_waits

    if not torch.cuda.is_available():
        return None
    _, waits = host_waits(lambda: _train_updates(cfg, run, run.state.step + updates, **kw))
    in_model = sum("/transformers/" in w for w in waits)
    return {"outside the model": (len(waits) - in_model) / updates, "in the model": in_model / updates}


def packing(threads: int, overrides: list[str], windows: int = 12, repeats: int = 3) -> dict[str, Any]:
    """Seconds of forward and backward over ``windows`` SMS windows (b=8, k=4), each cut three ways.

    *equal*: the sorted window in four micro-batches of 8 (the cut on several
    processes); *balanced*: :class:`~finetune.sampling.BalancedBatches`' cut
    (the default on one process); *packed*: the window's texts packed
    first-fit into rows of ``max_length`` tokens, the rows in four
    micro-batches, attention kept within each text by a block-diagonal mask,
    positions restarting at each text, and each text's first token pooled into
    the classifier (BERT's pooler and head, called by hand). Arms alternate;
    medians of ``repeats``. Padding is each arm's share of padded positions.
    """
    import torch

    from bench.common import load_job
    from bench.levers import _alternating
    from finetune.sampling import BalancedBatches, EpochSampler

    set_threads(threads)
    cfg = job_config(ArmSpec("ours", "sms", 8, 4, precision="bf16" if _bf16_native() else "no"),
                     ["data.balance_micro_batches=false"] + overrides)
    tokenizer, tokenized, labels, model, _ = load_job(cfg)
    ids, lengths = tokenized["train"]["input_ids"], tokenized["train"]["length"]
    sampler = EpochSampler(len(lengths), seed=cfg.training.seed, lengths=lengths, group_by_length=True,
                           window_size=32)
    order, balanced = sampler.order(), BalancedBatches(sampler, 8).micro_batches()
    width = cfg.data.max_length
    cuts = {
        "equal": [[order[w + i:w + i + 8] for i in range(0, 32, 8)] for w in range(0, 32 * windows, 32)],
        "balanced": [balanced[4 * w:4 * w + 4] for w in range(windows)],
    }
    cuts["packed"] = [_pack([ids[j] for j in sum(window, [])], width) for window in cuts["equal"]]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.training.mixed_precision == "bf16")
    model.train()

    def padded_batch(rows):
        x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for r, row in enumerate(rows):
            x[r, :len(row)] = torch.tensor(row)
        return x, (torch.arange(x.shape[1]) < torch.tensor([len(r) for r in rows])[:, None]).long()

    def plain(name):
        def step():
            for window in cuts[name]:
                for micro in window:
                    x, mask = padded_batch([ids[j] for j in micro])
                    with autocast:
                        logits = model(input_ids=x, attention_mask=mask).logits
                    logits.float().sum().backward()
        return step

    def packed():
        bert = model.bert
        for window in cuts["packed"]:
            for x, positions, keep, firsts in window:
                with autocast:
                    hidden = bert(input_ids=x, attention_mask=keep, position_ids=positions).last_hidden_state
                    pooled = bert.pooler.activation(bert.pooler.dense(hidden[firsts]))
                    logits = model.classifier(model.dropout(pooled))
                logits.float().sum().backward()

    def share(name):
        if name == "packed":
            real = sum(len(ids[j]) for window in cuts["equal"] for micro in window for j in micro)
            return 1 - real / sum(x.numel() for window in cuts["packed"] for x, *_ in window)
        rows = [[len(ids[j]) for j in micro] for window in cuts[name] for micro in window]
        return 1 - sum(map(sum, rows)) / sum(len(r) * max(r) for r in rows)

    times = _alternating({"equal": plain("equal"), "balanced": plain("balanced"), "packed": packed},
                         repeats=repeats, warmup=1)
    return {"windows": windows, "threads": threads, "precision": cfg.training.mixed_precision,
            "times": times, "padding": {name: share(name) for name in times}}


def _pack(texts: list[list[int]], width: int) -> list[tuple]:
    """Texts packed first-fit (longest first) into rows of ``width``, the rows in four micro-batches.

    Each micro-batch: token ids, positions restarting per text, a boolean
    ``(rows, 1, L, L)`` mask keeping attention within each text, and the
    ``(row, column)`` index of each text's first token.
    """
    import torch

    rows: list[list[list[int]]] = []
    for text in sorted(texts, key=len, reverse=True):
        row = next((r for r in rows if sum(map(len, r)) + len(text) <= width), None)
        if row is None:
            rows.append([text])
        else:
            row.append(text)
    rows.sort(key=lambda r: sum(map(len, r)))
    per = -(-len(rows) // 4)
    out = []
    for start in range(0, len(rows), per):
        group = rows[start:start + per]
        length = max(sum(map(len, r)) for r in group)
        x = torch.zeros(len(group), length, dtype=torch.long)
        positions = torch.zeros_like(x)
        segment = torch.full((len(group), length), -1)
        first_rows, first_cols = [], []
        for r, row in enumerate(group):
            at = 0
            for s, text in enumerate(row):
                x[r, at:at + len(text)] = torch.tensor(text)
                positions[r, at:at + len(text)] = torch.arange(len(text))
                segment[r, at:at + len(text)] = s
                first_rows.append(r)
                first_cols.append(at)
                at += len(text)
        keep = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
        keep |= torch.eye(length, dtype=torch.bool)  # a padded position attends to itself: no empty row
        out.append((x, positions, keep[:, None], (torch.tensor(first_rows), torch.tensor(first_cols))))
    return out


def _bf16_native() -> bool:
    import torch

    from finetune.precisions import choose_precision

    return choose_precision("auto", torch.device("cpu"))[0] == "bf16"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_one(threads: int, b: int, k: int, updates: int, overrides: list[str]) -> dict[str, Any]:
    """RSS after every forward pass, backward pass and update of the BBC News job at (b, k), in this process."""
    cfg, run = _setup(overrides, "bbc", b, k, updates, threads)
    trace: list[tuple[int, str, float]] = []
    step = {"n": 0}
    run.model.register_forward_hook(lambda *_: trace.append((step["n"], "forward", _rss_mib())))
    backward = run.accelerator.backward

    def traced_backward(loss, **kw):
        backward(loss, **kw)
        trace.append((step["n"], "backward", _rss_mib()))

    run.accelerator.backward = traced_backward

    def on_update(state):
        step["n"] = state.step
        trace.append((state.step, "update", _rss_mib()))
        return False

    _train(cfg, run, updates, on_update=on_update)
    after_forward = {}
    for update, event, mib in trace:
        if event == "forward":
            after_forward[update] = max(after_forward.get(update, 0.0), mib)
    return {"b": b, "k": k, "updates": updates, "trace": trace,
            "max_after_forward_by_update": [after_forward[u] for u in sorted(after_forward)],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def rss(threads: int, overrides: list[str]) -> dict[str, Any]:
    """:func:`rss_one` for (8, 4) over 4 updates and (8, 1) over 16 (the same samples), each in a fresh process."""
    out = {}
    for b, k, updates in ((8, 4, 4), (8, 1, 16)):
        cmd = [sys.executable, "-m", "bench.probe", "--threads", str(threads), "rss-one", str(b), str(k), str(updates),
               *overrides]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")
        out[f"{b}x{k}"] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"threads": threads, "overrides": overrides, "runs": out}


def heap(threads: int, overrides: list[str], rounds: int = 6, updates: int = 8, warmup: int = 3) -> dict[str, Any]:
    """``training.cpu_heap`` keep against trim on the SMS job, in one process, paired round by round.

    Both settings leave glibc's thresholds adaptive (``trim`` only adds a
    ``malloc_trim`` after each update), so one process can alternate them:
    each round trains ``updates`` updates with each, in alternating order.
    Reports non-pad tokens/s (the rounds' windows differ, so compare within a
    round), minor page faults and system CPU seconds per update.
    """
    cfg, run = _setup(overrides, "sms", 8, 4, warmup + 2 * rounds * updates, threads)
    _train_heap(cfg, run, warmup, "keep")
    out: dict[str, list] = {"keep": [], "trim": []}
    for r in range(rounds):
        for setting in (("trim", "keep") if r % 2 == 0 else ("keep", "trim")):
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            result = _train_heap(cfg, run, run.state.step + updates, setting)
            seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            out[setting].append({"tokens_per_s": result.tokens / seconds,
                                 "faults_per_update": (after.ru_minflt - before.ru_minflt) / updates,
                                 "system_s_per_update": (after.ru_stime - before.ru_stime) / updates})
    ratios = [k["tokens_per_s"] / t["tokens_per_s"] for k, t in zip(out["keep"], out["trim"])]
    return {"threads": threads, "overrides": overrides, "rounds": rounds, "updates": updates, "runs": out,
            "keep_over_trim_by_round": ratios, "keep_over_trim_median": statistics.median(ratios)}


def casts(threads: int, overrides: list[str], rounds: int = 6, updates: int = 4, warmup: int = 3) -> dict[str, Any]:
    """``training.cast_once_per_update`` on against off on the BBC News job, in one process, paired by round.

    The setting is an argument of ``train_one_epoch``, so one run alternates
    it: each round trains ``updates`` updates with each, in alternating order.
    Per micro-batch: the wall time (median over the rounds), the aten ops
    dispatched (forward and backward, counted over one update by
    :class:`OpClock`), of them the casts (``_to_copy``), and on a GPU the CUDA
    kernels launched (one profiled update) and the peak memory. Casts are kept only under bf16 or
    fp16 autocast: pass ``training.mixed_precision=bf16`` where it is not ``auto``'s choice.
    """
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if TorchDispatchMode is None:
        raise SystemExit("`casts` needs torch.utils._python_dispatch.TorchDispatchMode, which this torch lacks")
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    settings = {"per micro-batch": False, "once per update": True}
    per_round = 2 * updates + 2 * (1 + gpu)  # timed, counted and profiled updates of both settings
    cfg, run = _setup(overrides, "bbc", 8, 4, warmup + rounds * 2 * updates + per_round, threads)
    k = run.accelerator.gradient_accumulation_steps
    _train_updates(cfg, run, warmup)
    out: dict[str, dict[str, Any]] = {name: {"ms_per_micro_batch": []} for name in settings}
    for name, once in settings.items():
        clock = OpClock()
        with clock, _counting_forwards(run.model) as forwards:
            _train_updates(cfg, run, run.state.step + 1, cast_once_per_update=once)
        out[name]["ops_per_micro_batch"] = sum(calls for calls, _ in clock.ops.values()) / forwards[0]
        out[name]["casts_per_micro_batch"] = clock.ops.get("aten::_to_copy", [0])[0] / forwards[0]
        if gpu:
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof, _counting_forwards(run.model) as forwards:
                _train_updates(cfg, run, run.state.step + 1, cast_once_per_update=once)
                sync()
            kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            out[name]["kernels_per_micro_batch"] = kernels / forwards[0]
    for r in range(rounds):
        for name in (settings if r % 2 == 0 else reversed(settings)):
            sync()
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            with _counting_forwards(run.model) as forwards:
                _train_updates(cfg, run, run.state.step + updates, cast_once_per_update=settings[name])
                sync()
            out[name]["ms_per_micro_batch"].append(1e3 * (time.perf_counter() - started) / forwards[0])
            if gpu:  # the largest peak of the setting's rounds
                peak = torch.cuda.max_memory_allocated() / 2**20
                out[name]["peak_mib"] = max(out[name].get("peak_mib", 0.0), peak)
    times = {name: statistics.median(r["ms_per_micro_batch"]) for name, r in out.items()}
    return {"threads": threads, "overrides": overrides, "device": torch.cuda.get_device_name() if gpu else "CPU",
            "precision": run.accelerator.mixed_precision, "k": k, "rounds": rounds, "updates": updates,
            "runs": out, "median_ms_per_micro_batch": times,
            "speedup": times["per micro-batch"] / times["once per update"]}


@contextmanager
def _counting_forwards(model):
    """The model's forward calls inside the block, in a one-item list: micro-batches, ragged windows included."""
    count = [0]
    handle = model.register_forward_pre_hook(lambda module, args: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def _train_heap(cfg, run, until: int, setting: str):
    from finetune.cpu import cpu_speedups, speedup_settings

    settings = {**speedup_settings(cfg.training), "heap": setting}
    with cpu_speedups(run.model, run.optimizer, run.accelerator, **settings):
        return _train_epoch_of(cfg, run, until)


def markdown(name: str, result: dict[str, Any]) -> str:
    if name == "masks":
        lines = [f"Dropout masks for a {tuple(result['shape'])} tensor, {result['threads']} threads, "
                 "medians of alternating calls:", "", "| generator | ns per element |", "| --- | ---: |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in result["ns_per_element"].items()]
        lines += ["", "One attention's forward and backward, b=8, 12 heads of 32, 32 tokens:", "",
                  "| attention | ms |", "| --- | ---: |"]
        lines += [f"| {k} | {v:.3f} |" for k, v in result["attention_ms"].items()]
    elif name == "profile":
        new = result["new_shape_matmuls"]
        lines = [f"SMS job (b=8, k=4), {result['updates']} updates, {result['threads']} threads"
                 f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}: "
                 f"{result['wall_s_per_update']:.3f} s per update untimed; with every op timed, "
                 f"{result['timed_wall_s_per_update']:.3f} s, of which {result['op_s_per_update']:.3f} s inside ops "
                 "(shares below are of that):", "",
                 "| group | share | ops (calls per update) |", "| --- | ---: | --- |"]
        lines += [f"| {k} | {100 * v:.1f}% | "
                  f"{', '.join(f'`{op}` ({c})' for op, c in result['group_calls'].get(k, {}).items())} |"
                  for k, v in result["groups"].items()]
        lines += ["", f"Matrix products at a shape not seen before (oneDNN builds a kernel first): "
                  f"{new['calls_per_update']:.0f} calls per update, {100 * new['share']:.1f}% of the time.", "",
                  "| op | share | calls per update | ms per call |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{t['op']}` | {100 * t['share']:.1f}% | {t['calls_per_update']:.0f} | {t['ms_per_call']:.3f} |"
                  for t in result["top"]]
    elif name == "packing":
        base = result["times"]["equal"]
        lines = [f"Forward and backward of {result['windows']} SMS windows (b=8, k=4), {result['threads']} threads, "
                 f"{result['precision']}, medians of alternating repeats:", "",
                 "| cut | padded positions | seconds | x equal |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {100 * result['padding'][name]:.1f}% | {t:.2f} | {base / t:.2f} |"
                  for name, t in result["times"].items()]
    elif name == "heap":
        lines = [f"`training.cpu_heap` on the SMS job (b=8, k=4), {result['threads']} threads, one process, "
                 f"{result['rounds']} rounds of {result['updates']} updates per setting"
                 f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}; keep / trim "
                 f"by round: {', '.join(f'{r:.2f}' for r in result['keep_over_trim_by_round'])} "
                 f"(median {result['keep_over_trim_median']:.2f})", "",
                 "| setting | tokens/s (median) | page faults per update (median) | system s per update (median) |",
                 "| --- | ---: | ---: | ---: |"]
        for setting, runs in result["runs"].items():
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            lines.append(f"| {setting} | {med['tokens_per_s']:.0f} | {med['faults_per_update']:.0f} "
                         f"| {med['system_s_per_update']:.3f} |")
    elif name == "device":
        lines = [f"{result['device']}, BBC News job, B={result['effective_batch_size']}, "
                 f"{result['micro_batches_per_update']} micro-batches per update, {result['updates']} updates per "
                 f"round, {result['rounds']} alternating rounds"
                 f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}; peak "
                 f"{result['peak_mib']:.0f} MiB:", "",
                 "| way | ms per update, by round | samples/s | GPU kernels ms per update | GPU busy "
                 "| host waits for the GPU per update: outside the model, in it (transformers) |",
                 "| --- | --- | ---: | ---: | ---: | ---: |"]
        for way, r in result["ways"].items():
            w = r["waits_per_update"]
            waits = "n/a (no GPU)" if w is None else f"{w['outside the model']:.1f}, {w['in the model']:.1f}"
            kernel = r.get("kernel_s_per_update")
            busy = "" if not kernel else f"{100 * kernel / statistics.median(r['wall_s_per_update']):.0f}%"
            lines.append(f"| {way} | {', '.join(f'{1e3 * x:.1f}' for x in r['wall_s_per_update'])} "
                         f"| {r['samples_per_s']:.0f} | {'' if not kernel else f'{1e3 * kernel:.1f}'} | {busy} "
                         f"| {waits} |")
        for way, r in result["ways"].items():
            if "kernels" not in r:
                continue
            if r["kernels"]:
                lines += ["", f"| kernel ({way}) | ms per update | calls per update |", "| --- | ---: | ---: |"]
                lines += [f"| `{k['kernel']}` | {k['s_per_update'] * 1e3:.2f} | {k['calls_per_update']:.0f} |"
                          for k in r["kernels"]]
            lines += ["", f"| op ({way}, self CPU, profiled) | ms per update | calls per update |",
                      "| --- | ---: | ---: |"]
            lines += [f"| `{k['op']}` | {k['s_per_update'] * 1e3:.2f} | {k['calls_per_update']:.0f} |"
                      for k in r["cpu_ops"]]
    elif name == "casts":
        gpu = "kernels_per_micro_batch" in result["runs"]["per micro-batch"]
        lines = [f"`training.cast_once_per_update` on the BBC News job, {result['device']}, {result['precision']}, "
                 f"k={result['k']}, {result['rounds']} rounds of {result['updates']} updates per setting"
                 f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}; once per update is "
                 f"{result['speedup']:.3f}x per micro-batch (medians):", "",
                 "| weight casts | ms per micro-batch (median) | aten ops per micro-batch | of them casts |"
                 + (" CUDA kernels per micro-batch | GPU peak MiB |" if gpu else ""),
                 "| --- | ---: | ---: | ---: |" + (" ---: | ---: |" if gpu else "")]
        for setting, r in result["runs"].items():
            lines.append(f"| {setting} | {result['median_ms_per_micro_batch'][setting]:.1f} "
                         f"| {r['ops_per_micro_batch']:.0f} | {r['casts_per_micro_batch']:.0f} |"
                         + (f" {r['kernels_per_micro_batch']:.0f} | {r['peak_mib']:.0f} |" if gpu else ""))
    else:
        lines = ["RSS (MiB) of the BBC News job, highest after a forward pass in each update, and the "
                 f"process's peak{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}:", "",
                 "| b x k | updates | after forward, by update | median | peak RSS |", "| --- | ---: | --- | ---: | ---: |"]
        for key, r in result["runs"].items():
            by_update = r["max_after_forward_by_update"]
            lines.append(f"| {key.replace('x', ' x ')} | {r['updates']} | {', '.join(f'{v:.0f}' for v in by_update)} "
                         f"| {statistics.median(by_update):.0f} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    threads = 2
    if argv[:1] == ["--threads"]:
        threads, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["rss-one"]:  # the child of `rss`
        b, k, updates = (int(v) for v in argv[1:4])
        result = rss_one(threads, b, k, updates, argv[4:])
        print(json.dumps(result))
        return 0
    if not argv or argv[0] not in ("masks", "profile", "rss", "device", "packing", "heap", "casts"):
        print(__doc__.strip().splitlines()[0] + "\nusage: python -m bench.probe [--threads N] "
              "masks | profile [section.key=value ...] | rss [section.key=value ...] | device [section.key=value ...] | packing "
              "| heap [section.key=value ...] | casts [section.key=value ...]")
        return 2
    name, overrides = argv[0], argv[1:]
    started = time.perf_counter()
    probes = {"masks": lambda: masks(threads), "profile": lambda: profile(threads, overrides),
              "rss": lambda: rss(threads, overrides), "device": lambda: device(threads, overrides),
              "packing": lambda: packing(threads, overrides), "heap": lambda: heap(threads, overrides),
              "casts": lambda: casts(threads, overrides)}
    result = probes[name]()
    result["seconds"] = time.perf_counter() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / f"probe_{name}.json", result)
    print(markdown(name, result), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
