"""A micro-batch's forward and backward replayed from CUDA graphs (``training.cuda_graphs``).

On a GPU a base-sized encoder's micro-batch is bound by its kernel launches
(about 1,250 per micro-batch of bert-base), not by the kernels: the host
takes longer to launch them than the GPU takes to run them. A CUDA graph
launches a captured sequence of kernels in one call. What a graph needs, and
how the contract of ``docs/accumulation.md`` is kept:

- **Fixed shapes.** Every micro-batch is padded to ``b`` rows and to one of a
  few lengths (the lengths of :class:`~finetune.dataloaders.BucketPadding`,
  which the collator then pads to). The added rows repeat the first text and
  weigh 0, as the repeated samples that even out processes already do; the
  loss sums the real rows only. One graph per length, all sharing one memory
  pool (they never run at the same time).
- **Gradients that stay put.** A captured backward adds into the memory the
  gradients had at capture, so they exist before it (zeros) and are zeroed in
  place after each update, never freed; a gradient replaced since the capture
  (``zero_grad(set_to_none=True)`` by a caller) makes the graphs be captured
  again, never replayed into freed memory.
- **Inputs that stay put.** Each micro-batch is copied into the graph's own
  input tensors, and the window's loss scale into a device tensor, before the
  replay. The optimizer step, clipping and the scheduler run as before,
  between windows: a few multi-tensor kernels per update, against some two
  thousand per micro-batch, and the non-finite check reads the norm on the
  host before the step, which a replay could not.
- **Random numbers.** Dropout in a replay draws from the default CUDA
  generator, which advances by the same amount at each replay. The warm-up
  and the capture run under :func:`torch.random.fork_rng`, so the run's
  stream is the replays' alone, wherever a run (or its resume) captures.

Why by hand and not inductor's ``mode="reduce-overhead"``: its CUDA graph
trees hand the same output memory to successive replays, and with gradient
accumulation a replay may overwrite a gradient the window still holds
(pytorch/pytorch#169545). Here the graph's only output is the loss; the
gradients are the parameters' own.

With ``training.torch_compile`` as well, the graphs hold inductor's fused
kernels: the model's forward (or, under ``blocks``, each encoder block) is
compiled in inductor's default mode (no graphs of its own), compiled during
the warm-up, before the capture (a capture must not compile: compiling
launches kernels of its own; the warm-up keeps the attention mask as the
capture does, :func:`_show_padding`), and captured by hand as above. Fusion
cuts what the GPU does; the graph cuts what the host does. Compiled blocks
cost the host a guard check per block each micro-batch when run eagerly;
replayed from a graph they cost it nothing.

Where it does not apply, the micro-batch runs eagerly and the reason is
logged once: no CUDA device; several processes (DDP's all-reduce hooks,
FSDP's and DeepSpeed's engines are not capture-safe); fp16 (its grad scaler
reads the scale on the host); gradient checkpointing (it saves and restores
the generator's state, which a capture forbids); ``data.truncation: chunks``
(the windows per text vary); a batch of other keys or longer than the longest
length; more than :data:`MAX_GRAPHS` lengths; and, from the micro-batch on
whose capture CUDA refused (a model whose forward reads a tensor on the host, or
a tensor of an eager forward, a kept loss say, still holding its autograd graph),
every micro-batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional

import torch

from finetune.attention_kernel import asked_kernel

logger = logging.getLogger("finetune")

# lengths (graphs) kept at most; each holds its inputs, the pool is shared
MAX_GRAPHS = 8
# eager runs before a capture (on a side stream on CUDA), every row weighted 0: they add nothing to the gradients
WARMUP_RUNS = 3
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def why_not_graphed(accelerator, *, checkpointing: bool, chunked: bool) -> Optional[str]:
    """Why micro-batches cannot be replayed from CUDA graphs in this run (``None``: they can)."""
    from accelerate.utils import DistributedType

    if not hasattr(torch.cuda, "graph") or not hasattr(torch.Generator, "clone_state"):
        return "this torch has no torch.cuda.graph or cannot restore its generator after a refused capture (torch 2.5+)"
    if accelerator.device.type != "cuda":
        return "no CUDA device"
    if accelerator.num_processes > 1 or accelerator.distributed_type in (DistributedType.FSDP,
                                                                         DistributedType.DEEPSPEED):
        return "several processes or a sharding engine (their communication is not captured safely)"
    if accelerator.mixed_precision == "fp16":
        return "fp16 (the grad scaler's checks run on the host)"
    if checkpointing:
        return "gradient checkpointing (it saves the generator's state, which a capture forbids)"
    if chunked:
        return "data.truncation: chunks (the number of windows per text varies)"
    return None


def graphed(setting, accelerator, *, checkpointing: bool, chunked: bool) -> bool:
    """Whether micro-batches are replayed from CUDA graphs: ``training.cuda_graphs`` resolved.

    ``true``: wherever they can be (:func:`why_not_graphed`). ``auto``: where they can be and were
    measured to pay, which is in bf16 autocast, the precision ``training.mixed_precision: auto`` takes on a
    GPU that computes it: bert-base at b=64 on an H200 trained 1.55x as fast as eagerly over a 40-update
    run, ahead from the first update (bench/README.md). fp32, where each kernel runs longer and the
    host's launches matter less, is not measured, so ``auto`` leaves it eager.
    """
    if setting is False or why_not_graphed(accelerator, checkpointing=checkpointing, chunked=chunked) is not None:
        return False
    return setting is True or accelerator.mixed_precision == "bf16"


def why_not_for_run(run) -> Optional[str]:
    """:func:`why_not_graphed` for a :class:`~finetune.run.Run`."""
    from finetune.truncation import truncation_of

    return why_not_graphed(run.accelerator, checkpointing=run.checkpointing.on,
                           chunked=truncation_of(run.cfg.data).chunked)


def graphed_run(run) -> bool:
    """:func:`graphed` for a :class:`~finetune.run.Run`."""
    from finetune.truncation import truncation_of

    return graphed(run.cfg.training.cuda_graphs, run.accelerator, checkpointing=run.checkpointing.on,
                   chunked=truncation_of(run.cfg.data).chunked)


def graphs_for_run(run, loss_fn: Optional[Callable] = None) -> Optional["GraphedMicroBatches"]:
    """``training.cuda_graphs`` for a :class:`~finetune.run.Run`: its :class:`GraphedMicroBatches`, or
    ``None`` where the setting resolves to eager steps (:func:`graphed_run`; said once, with why, where
    ``true`` asked for graphs that cannot apply). Its lengths are those the training collator pads to
    (:func:`finetune.dataloaders.fixed_lengths` chose :class:`~finetune.dataloaders.BucketPadding` where
    graphs run); its loss ``loss_fn``, else the run's (the config's class weights and label smoothing)."""
    if not graphed_run(run):
        why = why_not_for_run(run)
        if run.cfg.training.cuda_graphs is True and why is not None:
            logger.warning("training.cuda_graphs: not applied (%s); micro-batches run eagerly", why)
        return None
    return GraphedMicroBatches(run.model, loss_fn or run.task.per_sample_loss, rows=run.batching.per_device_batch_size,
                               lengths=run.train_dataloader.collate_fn.sizes,
                               pad_token_id=run.tokenizer.pad_token_id or 0,
                               precision=run.accelerator.mixed_precision, compiled=run.cfg.training.torch_compile)


def record_cuda_graph(step: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], torch.Tensor], object]:
    """Capture ``step`` in a CUDA graph; returns its replay (which returns ``step``'s output tensor, updated in
    place) and the graph's memory pool, to share with the next capture."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    generator = torch.cuda.default_generators[stream.device.index]
    before = generator.clone_state()
    try:
        # thread_local: the dataloader's pin-memory thread may allocate host memory meanwhile, which is harmless
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = step()
    except RuntimeError:
        # A capture CUDA refused ends without torch's epilogue: the generator stays in capture mode (the next
        # eager dropout raises "Offset increment outside graph capture") and the capture stream stays current.
        # Both go back to where they were, for the eager micro-batches that follow.
        torch.cuda.set_stream(stream)
        generator.graphsafe_set_state(before)
        raise

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, graph.pool()


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Run the block on a side stream that starts after the current stream's work, and make the current stream
    wait for it: torch's recipe for the eager runs before a capture. Off CUDA, the block runs as it is."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def refusal(error: RuntimeError) -> str:
    """CUDA's reason for refusing a capture, in one line, with what causes the one a caller can fix."""
    # CUDA invalidates a capture at the refused operation, and ending it then raises again: the first error says why
    while "previous error during capture" in str(error) and isinstance(error.__context__, RuntimeError):
        error = error.__context__
    said = str(error).strip().splitlines()[0]
    if "legacy stream depend on a capturing" in said:
        # the parameters' gradient accumulators outlive a graph only while that graph lives, and one made on the
        # default stream cannot take a gradient made on the capture's stream
        said += "; a tensor from an eager forward, such as a kept loss, still holds its autograd graph"
    return said


def pool_bytes(pool) -> Optional[int]:
    """The device memory a graph memory pool holds, or ``None`` for no pool (a CPU).

    Between replays that memory (the graphs' activations) is reserved but not counted as allocated, so
    ``torch.cuda.max_memory_allocated`` leaves it out of a run's peak: this is the part to add.
    """
    if pool is None or not torch.cuda.is_available():
        return None
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:  # an allocator backend without snapshots (cudaMallocAsync): unknown, not a failed run
        return None
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool))


def rerun_eagerly(step: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], torch.Tensor], object]:
    """A recorder that captures nothing: each "replay" runs the step again. The fixed-shape step without
    graphs, for checks on a CPU and for measuring what the graphs themselves save."""
    return step, pool


def _show_padding(inputs: dict[str, torch.Tensor]) -> None:
    """Where the warm-up's attention mask has no padding, mark one position as padding (the last row's last
    token), so that the warm-up keeps the mask as the capture will. A mask with padding is kept anyway, and
    stays as it is: with left padding, its last position may be a text's only token.

    Eagerly, transformers drops a mask without padding before attention; while a graph is captured it cannot
    look at the mask, so it keeps it. A compiled block (``training.torch_compile: blocks``) warmed up without
    the mask would be compiled again in the capture, for the mask, which CUDA refuses: compiling runs kernels
    and reads values on the host. Micro-batches whose texts fill their length, as long texts do, met exactly
    that. The warm-up's rows weigh 0 and each replay loads its own inputs, so the mark changes nothing else.

    Computed on the device: asking the host whether the mask has padding, or writing a Python number into it,
    would make the host wait for the GPU.
    """
    mask = inputs.get("attention_mask")
    if mask is not None and mask.shape[1] > 1:
        mask[-1:, -1:].mul_(mask.all().logical_not().to(mask.dtype))  # times 0 where no position is padding


class GraphedMicroBatches:
    """Forward and backward of fixed-shape micro-batches, one captured graph per length.

    Args:
        model: The prepared model (one process), in training mode.
        loss_fn: ``loss_fn(logits, labels) -> per-sample losses``, capture-safe
            (no host transfer: class weights already on the device).
        rows: Every micro-batch is padded to this many rows (the run's ``b``).
        lengths: The lengths micro-batches are padded to (ascending).
        pad_token_id: What ``input_ids`` are padded with.
        precision: ``"bf16"`` (autocast) or ``"no"`` (fp32).
        recorder: How a step is captured: :func:`record_cuda_graph`, or :func:`rerun_eagerly`.
        compiled: ``training.torch_compile``. ``True``: compile the model's forward with ``torch.compile``
            (inductor's default mode), so that the graphs hold its fused kernels. ``"blocks"``: the encoder
            blocks were compiled in place beforehand (:func:`finetune.modeling.compile_model`), so the graphs
            hold theirs; nothing is compiled here.
    """

    def __init__(self, model, loss_fn, rows: int, lengths: list[int], pad_token_id: int = 0,
                 precision: str = "no", recorder=record_cuda_graph, compiled: bool | str = False) -> None:
        # the model's own forward, without the autocast Accelerate wraps around it: the step enters its own,
        # with the weight-cast cache off, as torch asks under capture. Compiled, it is this forward that is
        # compiled (not the model's own compiled call, which goes through Accelerate's wrapper)
        forward = type(model).forward.__get__(model)
        self.forward = torch.compile(forward) if compiled is True else forward
        self.compiled = compiled
        self.model, self.loss_fn, self.rows, self.lengths = model, loss_fn, rows, sorted(lengths)
        self.pad_token_id, self.recorder = pad_token_id, recorder
        if precision not in ("bf16", "no"):
            raise ValueError(f"precision must be 'bf16' or 'no', got {precision!r} (fp16's grad scaler is not "
                             "captured)")
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        self.device = next(model.parameters()).device
        self.graphs: dict[int, tuple[Callable[[], torch.Tensor], dict[str, torch.Tensor]]] = {}
        self.pool = None
        self.scale = torch.zeros((), dtype=torch.float32, device=self.device)
        self.keys: Optional[tuple[str, ...]] = None
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.capture_seconds = 0.0
        self.said: set[str] = set()
        self.failed: Optional[str] = None  # why no graph is replayed any more, once a capture failed

    def takes(self, batch: dict[str, torch.Tensor]) -> bool:
        """Whether this micro-batch can be replayed; when not (said once per reason), the caller runs it eagerly.

        A length met for the first time is captured here, so that a model whose forward cannot be captured
        (one that reads a tensor on the host, say) is found before its micro-batch is due: that micro-batch
        and every later one then run eagerly, which the capture's warm-up left the gradients ready for.
        """
        why = self._why_not(batch)
        if why is None:
            try:
                self._graph_for(batch)
            except RuntimeError as error:  # CUDA refused the capture: eagerly from here (the GPU tests hold it)
                self.failed = f"the capture failed ({refusal(error)}), so from here on"
                why = self.failed
        if why is not None and why not in self.said:
            self.said.add(why)
            logger.warning("training.cuda_graphs: a micro-batch runs eagerly: %s", why)
        return why is None

    def forward_backward(self, batch: dict[str, torch.Tensor], real: int,
                         loss_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the micro-batch's forward and the backward of ``loss_scale`` times its summed loss over its first
        ``real`` rows, adding into the parameters' gradients; returns that sum and the rows' non-pad tokens."""
        replay, inputs = self._graph_for(batch)
        self._load(inputs, batch, real)
        self.scale.fill_(loss_scale)
        loss_sum = replay().clone()  # the next replay overwrites the graph's output
        return loss_sum, batch["attention_mask"][:real].sum()

    def record(self) -> dict:
        """What was captured, for ``metrics.json``: the lengths, the seconds their capture took (compiling
        included), what was compiled (``training.torch_compile``), the bytes their shared memory pool holds
        (``None`` without one), and why micro-batches ran eagerly from a refused capture on (``None``: none
        was refused), which a run's speed alone would hide."""
        return {"lengths": sorted(self.graphs), "capture_seconds": round(self.capture_seconds, 3),
                "compiled": self.compiled, "pool_bytes": pool_bytes(self.pool), "refused": self.failed}

    # ----------------------------------------------------------------------------------------- the parts

    def _why_not(self, batch: dict[str, torch.Tensor]) -> Optional[str]:
        n, length = batch["input_ids"].shape
        keys = tuple(sorted(batch))
        other = sorted(set(keys) - set(TOKEN_KEYS) - {"labels"})
        return (self.failed if self.failed is not None
                else f"it has {other[0]!r}, which the graph does not pass to the model" if other
                else "its keys differ from the first micro-batch's" if self.keys not in (None, keys)
                else f"{n} rows, more than b={self.rows}" if n > self.rows
                else f"length {length}, longer than {self.lengths[-1]}" if length > self.lengths[-1]
                else f"more than {MAX_GRAPHS} lengths" if self._width(length) not in self.graphs
                and len(self.graphs) >= MAX_GRAPHS else None)

    def _graph_for(self, batch: dict[str, torch.Tensor]) -> tuple[Callable[[], torch.Tensor], dict[str, torch.Tensor]]:
        """The replay and the inputs of the batch's length, captured first where needed."""
        if not self._gradients_intact():
            self._forget("the gradients were replaced since the capture")
        width = self._width(batch["input_ids"].shape[1])
        if width not in self.graphs:
            self._capture(width, batch)
        return self.graphs[width]

    def _width(self, length: int) -> int:
        return next(size for size in self.lengths if size >= length)

    def _step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """What a graph holds: forward, the weighted sum of per-sample losses, backward; returns the sum."""
        model_inputs = {key: inputs[key] for key in TOKEN_KEYS if key in inputs}
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None, cache_enabled=False), \
                asked_kernel(self.model):  # training.attention_kernel, which the model's hooks would enter
            logits = self.forward(**model_inputs).logits
        per_sample = self.loss_fn(logits.float(), inputs["labels"])
        # where, not a product: a padded row's NaN must not reach the sum
        loss_sum = torch.where(inputs["weights"], per_sample, torch.zeros_like(per_sample)).sum()
        (loss_sum * self.scale).backward()
        return loss_sum.detach()

    def _load(self, inputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], real: int) -> None:
        """Copy ``batch`` into the graph's inputs: its rows first, then the first row again; pad tokens after its
        length; rows past ``real`` weigh 0."""
        n, length = batch["input_ids"].shape
        for key, value in batch.items():
            target = inputs[key]
            if key in TOKEN_KEYS:
                target[:n, :length].copy_(value, non_blocking=True)
                target[:n, length:].fill_(self.pad_token_id if key == "input_ids" else 0)
            else:
                target[:n].copy_(value, non_blocking=True)
            target[n:] = target[0]
        torch.lt(inputs["row"], real, out=inputs["weights"])

    def _capture(self, width: int, batch: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        self.keys = tuple(sorted(batch))
        inputs = {key: value.new_zeros((self.rows, width) if key in TOKEN_KEYS else
                                       (self.rows,) + tuple(value.shape[1:])) for key, value in batch.items()}
        inputs["row"] = torch.arange(self.rows, device=self.device)
        inputs["weights"] = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        self._load(inputs, batch, real=0)  # every row weighs 0 in the warm-up
        if self.recorder is not rerun_eagerly:  # whose "replays" run eagerly, as the warm-up does unmarked
            _show_padding(inputs)
        had_gradient = {p for p in self.model.parameters() if p.grad is not None}
        cuda = self.device.type == "cuda"
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if cuda else []
        with torch.random.fork_rng(devices=devices):
            # the warm-up also compiles a compiled forward (and its backward) for this length
            with side_stream(self.device):
                for _ in range(WARMUP_RUNS):
                    self._step(inputs)
            # a gradient the warm-up created (zeros, on the side stream) is made again on this one
            for p in self.model.parameters():
                if p.grad is not None and p not in had_gradient:
                    p.grad = torch.zeros_like(p)
            replay, self.pool = self.recorder(lambda: self._step(inputs), self.pool)
        self.graphs[width] = (replay, inputs)
        self.grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        self.capture_seconds += time.perf_counter() - started
        logger.debug("training.cuda_graphs: captured length %d (%d graphs, %.1f s in all)", width,
                     len(self.graphs), self.capture_seconds)

    def _gradients_intact(self) -> bool:
        return all(p.grad is grad for p, grad in self.grads)

    def _forget(self, why: str) -> None:
        if why not in self.said:
            self.said.add(why)
            logger.warning("training.cuda_graphs: %s; capturing again", why)
        self.graphs, self.pool, self.grads = {}, None, []
