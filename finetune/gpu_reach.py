"""Whether torch reaches the NVIDIA GPUs of the machine, and the caution for work on its CPU beside them: a run's
after its start line (:mod:`finetune.placement`), a trained model's predictions' (:mod:`finetune.ensemble`).

Kept out of :mod:`finetune.placement`, which reads a run and so reaches the training side, where predicting must not.
"""

from __future__ import annotations

import os

from finetune.machine import nvidia_gpus


def gpus_hidden_on_purpose() -> bool:
    """Whether the work was told to leave the GPUs alone: ``CUDA_VISIBLE_DEVICES`` empty or -1, or
    ``accelerate launch --cpu`` (``ACCELERATE_USE_CPU``)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (hidden is not None and hidden.strip() in ("", "-1")) or \
        os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes")


def unreached_gpus(device, doing: str, verb: str) -> str | None:
    """The caution for work on the CPU of a machine whose NVIDIA driver drives GPUs: torch built without CUDA, or
    one that cannot reach them (a driver older than its CUDA), runs many times slower than the GPU would, and the
    device alone does not say why. ``doing`` says the work (``"the run trains"``), ``verb`` what a torch with CUDA
    would do on the GPUs (``"trains"``). None where the GPUs were hidden on purpose (``CUDA_VISIBLE_DEVICES`` empty
    or -1, ``accelerate launch --cpu``), or where torch reaches them and the work was put on the CPU all the same."""
    if device.type != "cpu" or gpus_hidden_on_purpose():
        return None
    gpus = nvidia_gpus()
    if not gpus:
        return None
    import torch

    them = "them" if gpus > 1 else "it"
    shown = f"this machine has {gpus} NVIDIA GPU{'s' if gpus > 1 else ''} and {doing} on the CPU"
    if torch.version.cuda is None:
        return (f"{shown}: torch {torch.__version__} is a build without CUDA; one with CUDA {verb} on {them} "
                f"(the command for this machine: pytorch.org/get-started/locally)")
    if not torch.cuda.is_available():
        return (f"{shown}: torch {torch.__version__}, built for CUDA {torch.version.cuda}, cannot reach {them} "
                f"(torch.cuda.is_available() is False: most often a driver older than that CUDA needs; nvidia-smi "
                f"names the newest CUDA the driver runs)")
    return None
