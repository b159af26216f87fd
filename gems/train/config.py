"""Training configuration: one dataclass, filled from the command line.

Every field carries its help text; ``gems.cli.train`` turns the fields into flags
(``batch_size`` -> ``--batch-size``), so adding an option is adding a field here.
``validate`` checks the combinations no single flag can check. ``Recipe``, its base, holds the
switches of how fast each stage runs, shared with gems-bench and gems-predict.
"""
from __future__ import annotations

import ast
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gems.errors import GemsError
from gems.plan import PLACEMENT_CHOICES


# Beyond these, torch's tensor sizes (64-bit element counts) overflow while the model is built or
# profiled: a global batch of input elements (images x channels x pixels) leaves room for
# activations a thousand times wider (2**52 float32 elements are 16 PiB); ImageNet-21k has
# 21,841 classes.
MAX_INPUT_ELEMENTS = 2**52
MAX_CLASSES = 2**24


def opt(default, help: str, **kw):
    """A dataclass field carrying its --help text (and argparse extras such as choices)."""
    return field(default=default, metadata={"help": help, **kw})


MODEL_HELP = ("a gems.models name (resnet50, preact-resnet1001, amoebanet-d, ...), torchvision:NAME, timm:NAME, "
              "smp:ARCH:ENCODER, path/file.py:factory or package.module:factory")
MODEL_ARG_HELP = ("a keyword argument for the model's builder, KEY=VALUE (repeatable); VALUE is read as a Python "
                  "literal (3, 0.1, True, None, (1, 2)) when it is one, else as text")

SPATIAL_HELP = ("split each image of stage 0's first units across P ranks (a number, or a RxC grid) at each position "
                "holding stage 0; world = groups x (stages + (P-1) x those positions)")

PLACEMENT_HELP = ("where each stage's model state lives: device; host-optimizer (the optimizer's state and its update "
                  "in host memory, gradients copied out and parameters copied back each step); host (parameters "
                  "in host memory too, on the device per group of units while they run, gradients leaving as "
                  "made); auto (per stage: the fastest that fits --memory-budget, device where the state fits)")

HOST_BUDGET_HELP = ("host memory per rank for model state placed there and offloaded activations, e.g. 64GiB "
                    "(default: unbounded)")

# --split-backward: the words of gems.partition.backward.SPLIT_MODES (not imported here: it loads torch)
SPLIT_CHOICES = ("auto", "on", "off")
SPLIT_HELP = ("split each backward into input- and weight-gradient actions, the weight-gradients filling pipeline "
              "bubbles: on (the flag alone), off, or auto (the planner plans both ways and keeps the faster that "
              "fits the memory budget)")


def model_kwargs(pairs: Iterable[str]) -> dict[str, Any]:
    """``--model-arg`` values (``"drop_path_rate=0.1"``) as builder keyword arguments. A value is
    a Python literal where it parses as one, so numbers, booleans, None and tuples need no
    per-model type table; anything else (``act_layer=gelu``) stays a string."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise GemsError(f"--model-arg {pair!r} must be KEY=VALUE with a Python name as KEY, e.g. "
                            "--model-arg drop_path_rate=0.1")
        if key == "num_classes":
            raise GemsError("set the number of classes with --num-classes, not --model-arg num_classes=...")
        if key in kwargs:
            raise GemsError(f"--model-arg {key} is given twice; keep one")
        value = text.strip()
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):   # not a literal: text
            kwargs[key] = value
    return kwargs


# On CPU, channels_last is opt-in: gems-bench measured it faster on this project's CPU machine (resnet18, one
# rank, batch 2, medians of three launches: 3% at 256^2, 11% at 512^2; benchmarks/README.md, "The speed
# recipe on CPU"), but the profile's NHWC scratch model (oneDNN) still overestimates a U-Net stage by 13%,
# beyond the planner's 10%: the default stays NCHW on CPU until it does not.
CPU_FORMAT = "contiguous"


@dataclass
class Recipe:
    """The published recipe's switches (NVIDIA's ResNet-50 example, timm's --amp --channels-last
    --torchcompile): bf16 autocast, NHWC (``gems.plan.formats``; default on CUDA, where cuDNN's
    tensor-core kernels want it; on CPU ``CPU_FORMAT``), compiled stages (``gems.pipeline.compiled``)
    and cuDNN's autotuning (every shape here is fixed)."""

    amp: str = opt("none", "mixed precision: run forwards in bfloat16", choices=("none", "bf16"))
    channels_last: bool | None = opt(None, "hold parameters, activations and messages in channels_last (NHWC) "
                                     "memory format (default: yes on CUDA, no on CPU)")
    compile: bool = opt(False, "compile the stages with torch.compile before the first step, one graph per "
                        "run of units a forward runs as one (a unit that cannot be compiled runs eagerly, named once)")
    compile_cache: str | None = opt(None, "directory for the compiler's caches, kept across runs (default: "
                                    "CHECKPOINT_DIR/compile-cache for gems-train, else the compiler's own)")
    cudnn_benchmark: bool = opt(True, "let cuDNN time its algorithms for each (fixed) shape on CUDA")
    tf32: bool = opt(True, "let cuDNN run float32 convolutions on TF32 tensor cores on CUDA (torch's default; "
                     "--no-tf32: full float32, e.g. to compare a run with one on CPU)")

    def memory_format(self, device_type: str) -> str:
        """``"channels_last"`` or ``"contiguous"``: ``--channels-last`` if given, else by device."""
        if self.channels_last is not None:
            return "channels_last" if self.channels_last else "contiguous"
        return "channels_last" if device_type == "cuda" else CPU_FORMAT

    def autocast(self):
        """The dtype forwards run under with ``--amp`` (``Engine(autocast=...)``), or None."""
        import torch  # noqa: PLC0415 - the configuration itself loads no torch

        return torch.bfloat16 if self.amp == "bf16" else None

    def apply(self, device_type: str, workspace: int | None = None) -> None:
        """The process-wide part, once per process before any engine: cuDNN's autotuning and TF32, and with
        ``workspace`` (bytes, e.g. the room a memory budget leaves above the plan's estimate) the most
        convolution workspace cuDNN may take (PyTorch's ``CUDNN_CONV_WSCAP_DBG``, in MiB), so the
        algorithms it tries stay within the budget."""
        import os  # noqa: PLC0415

        import torch  # noqa: PLC0415 - the configuration itself loads no torch

        torch.backends.cudnn.benchmark = bool(self.cudnn_benchmark) and device_type == "cuda"
        torch.backends.cudnn.allow_tf32 = bool(self.tf32)
        if workspace is not None and device_type == "cuda":
            os.environ["CUDNN_CONV_WSCAP_DBG"] = str(max(0, workspace) // 2**20)

    def compiler(self, device_type: str, default_cache: str | None = None) -> None:
        """With ``--compile``, before the first compile on every rank: GemsError, one sentence, when the
        backend cannot work here (``gems.pipeline.compiler.check_backend``), and the compiler's caches
        pointed at ``--compile-cache`` (else ``default_cache``; neither: the compiler's own)."""
        if not self.compile:
            return
        from gems.pipeline import compiler  # noqa: PLC0415 - the configuration itself loads no torch

        compiler.check_backend(device_type)
        if self.compile_cache or default_cache:
            compiler.use_cache(self.compile_cache or default_cache)


@dataclass
class TrainConfig(Recipe):
    # what to train
    model: str = opt("resnet18", MODEL_HELP)
    model_arg: tuple[str, ...] = opt((), MODEL_ARG_HELP, metavar="KEY=VALUE")
    init_from: str | None = opt(None, "start from the state dict in this file (.pt, .pth or .safetensors), loaded "
                                "strictly into the model before training; mismatching keys stop the job")
    init_exclude: tuple[str, ...] = opt((), "with --init-from: keys matching this glob keep their initial values, "
                                        "e.g. 'fc.*' for a classifier head of another size (repeatable)",
                                        metavar="GLOB")
    num_classes: int | None = opt(None, "classes the model predicts (default: 10 for synthetic data; class folders "
                                  "and CSVs count their own; masks: values 0..N-1, background included, "
                                  "2 with --binary-masks)")
    task: str = opt("classification", "what the model learns: one class per image, or a class per pixel "
                    "(masks of class indices)", choices=("classification", "segmentation"))
    loss: str | None = opt(None, "loss: cross-entropy (default), bce (binary or multi-label, logits) or dice-ce "
                           "(segmentation: Dice per image averaged over images, plus cross-entropy)",
                           choices=("cross-entropy", "bce", "dice-ce"))
    class_weights: str | None = opt(None, "per-class loss weights, comma-separated, e.g. 0.2,1,1")
    label_smoothing: float = opt(0.0, "cross-entropy label smoothing in [0, 1)")
    ignore_index: int | None = opt(None, "mask value marking pixels to ignore in the loss and metrics, e.g. 255")
    binary_masks: bool = opt(False, "segmentation: any nonzero mask pixel is class 1 (masks stored as 0/255)")
    image_size: int = opt(2048, "side of the square input images, in pixels")
    # how to split it
    batch_size: int = opt(2, "global batch: images per optimizer step over all ranks")
    stages: int = opt(2, "K, stages per pipeline; data-parallel groups D = ranks / K")
    schedule: str = opt("mast", "pipeline schedule", choices=("mp", "gpipe", "1f1b", "mast"))
    micro_batches: int = opt(1, "micro-batches per replica per step")
    split_backward: str = opt("off", SPLIT_HELP + " (zero-bubble style)", choices=SPLIT_CHOICES, const="on",
                              negative="off")
    shard_optimizer: bool = opt(False, "each rank of a sync group (mirror pair x groups) updates a share of "
                                       "the parameters and keeps only their optimizer state")
    spatial: str | None = opt(None, SPATIAL_HELP + "; auto: the fewest P (none first) with which the launched ranks "
                                                    "split the batch and the plan fits --memory-budget")
    plan: str | None = opt(None, "use a plan saved by gems-plan --json instead of partitioning at start: its cuts, "
                                 "memory policies, split backward and spatial part stand, whatever the planning "
                                 "flags say; its stages, schedule, micro-batches, batch, image size and --spatial "
                                 "are the defaults of those flags")
    balance_by: str = opt("memory", "what the partitioner balances", choices=("memory", "time", "flops"))
    balance: str | None = opt(None, "manual units per stage, e.g. 3,5,4")
    split_points: str | None = opt(None, "module paths where stages 2, 3, ... begin, comma-separated, e.g. "
                                   "encoder.layer3,decoder.blocks.1 (instead of the partitioner)")
    leaf_module: tuple[str, ...] = opt((), "a module path or class name traced as one unit, never cut inside "
                                       "(e.g. a module whose forward branches on data)", metavar="NAME")
    memory_budget: str | None = opt(None, "per-device memory budget, e.g. 40GiB")
    enforce_memory_budget: bool = opt(False, "make the plan's budget a hard limit per rank (CPU: RLIMIT_DATA "
                                      "above the start-up memory; CUDA: the caching allocator's cap), so "
                                      "exceeding it stops the job with what to change")
    recompute: str = opt("none", "activation recomputation per stage: none, auto (only where the budget "
                         "needs it) or all", choices=("none", "auto", "all"))
    offload: str = opt("none", "saved activations to host memory per stage: none, auto or all",
                       choices=("none", "auto", "all"))
    state_placement: str = opt("device", PLACEMENT_HELP, choices=PLACEMENT_CHOICES)
    host_memory_budget: str | None = opt(None, HOST_BUDGET_HELP)
    # data
    data: str = opt("synthetic", "'synthetic', a folder of class folders, a CSV of path,label, or (segmentation) "
                    "a folder with images/ and masks/")
    augment: bool = opt(True, "random crops, flips, 90-degree rotations and colour jitter of training images "
                        "(masks follow their images)")
    val_data: str | None = opt(None, "validation data, laid out like --data; metrics over all of it")
    val_every: int = opt(0, "validate every N steps (0: only at the end, when --val-data is given)")
    val_batch_size: int | None = opt(None, "images per validation forward step over all ranks (default: --batch-size)")
    keep_best: str | None = opt(None, "also keep the checkpoint with the best value of this validation metric "
                                "(e.g. miou, top1, loss) in CHECKPOINT_DIR/best")
    workers: int = opt(2, "data loading processes per rank that reads images")
    seed: int = opt(0, "seed of the model initialisation, synthetic data and shuffling")
    # optimisation
    optimizer: str = opt("sgd", "optimizer", choices=("sgd", "adam", "adamw"))
    lr: float = opt(0.01, "peak learning rate (small: very large images mean few images per step)")
    momentum: float = opt(0.9, "SGD momentum")
    weight_decay: float = opt(0.0, "weight decay of weights; biases and normalisation layers' parameters "
                              "(every 1-dimensional parameter) get none")
    warmup_steps: int = opt(0, "linear learning-rate warm-up steps")
    lr_schedule: str = opt("cosine", "learning rate after warm-up", choices=("cosine", "constant", "step"))
    lr_milestones: str | None = opt(None, "--lr-schedule step: steps at which the rate is multiplied by "
                                    "--lr-gamma, comma-separated, e.g. 3000,6000")
    lr_gamma: float = opt(0.1, "--lr-schedule step: factor at each milestone")
    steps: int | None = opt(None, "optimizer steps to run (default: one epoch)")
    epochs: int | None = opt(None, "epochs to run (instead of --steps)")
    clip_grad_norm: float | None = opt(None, "clip the global gradient L2 norm to this value")
    skip_nonfinite: bool = opt(False, "skip a step whose loss is not finite instead of stopping")
    batch_norm: str = opt("micro-batch", "BatchNorm in training: micro-batch (PyTorch's behaviour on each "
                          "micro-batch), deferred (running statistics of the whole global batch, updated once "
                          "per step) or frozen (eval mode, for fine-tuning)",
                          choices=("micro-batch", "deferred", "frozen"))
    # runtime
    comm: str = opt("mpi", "communication backend", choices=("mpi", "torch"))
    allow_shared_gpu: bool = opt(False, "let several ranks of a node share a GPU when it has more ranks than "
                                 "visible GPUs (they split its memory and time); without it that stops the job")
    timeout: float = opt(300.0, "seconds a rank waits for a peer before aborting the job")
    # output
    metrics: str | None = opt(None, "write one JSON line per step (and per validation) to this file")
    tensorboard: str | None = opt(None, "write TensorBoard scalars (loss, learning rate, images/s, peak memory "
                                  "per rank, validation metrics) and validation images to this directory")
    checkpoint_dir: str | None = opt(None, "directory for checkpoints")
    checkpoint_every: int = opt(0, "save a checkpoint every N steps (0: only at the end and on a signal)")
    keep_checkpoints: int = opt(0, "keep only the newest N complete checkpoints (0: keep all)")
    resume: bool = opt(False, "continue from the newest complete checkpoint in --checkpoint-dir")
    trace: str | None = opt(None, "write a Chrome/Perfetto trace (JSON) of every rank's actions in the last 3 steps")
    trace_png: str | None = opt(None, "draw the same timeline as a PNG (needs matplotlib: the 'plot' extra)")
    plan_png: str | None = opt(None, "draw the plan as a PNG before training: memory per position by kind, with the "
                               "budget, and one simulated step (needs matplotlib: the 'plot' extra)")
    dry_run: bool = opt(False, "print the plan and the batch split, then exit")
    progress: bool = opt(True, "show a progress bar on rank 0")

    @staticmethod
    def plan_defaults(path: str) -> dict:
        """The layout of the plan at ``path`` (``gems-plan --json``) as option values, the defaults
        ``--plan FILE`` gives, so that ``gems-train --plan FILE`` needs no flag the plan settles;
        a flag given anyway must agree with the plan (``gems.train.planning.make_plan`` says so)."""
        from gems.plan import Plan  # noqa: PLC0415 - read only when --plan is given

        plan = Plan.from_json(path)
        values = {"stages": plan.stages, "schedule": plan.schedule, "micro_batches": plan.micro_batches,
                  "batch_size": plan.batch_size, "spatial": "x".join(map(str, plan.spatial_grid)) or None}
        square = len(plan.input_shape) >= 3 and plan.input_shape[-1] == plan.input_shape[-2]
        return values | ({"image_size": plan.input_shape[-1]} if square else {})

    def tiles(self) -> int:
        """P, the ranks of a tile group (1 without --spatial); GemsError unless P or RxC."""
        return tile_count(self.spatial, "gems-train")

    def validate(self) -> None:
        """Raise GemsError for values or combinations that cannot work."""
        for name in ("num_classes", "image_size", "batch_size", "stages", "micro_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise GemsError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.batch_size * 3 * self.image_size ** 2 > MAX_INPUT_ELEMENTS or (self.num_classes or 0) > MAX_CLASSES:
            raise GemsError(f"a batch of {self.batch_size} images of {self.image_size}x{self.image_size} pixels or "
                            f"{self.num_classes} classes is beyond torch's tensor sizes: use a smaller --batch-size "
                            f"or --image-size, and at most {MAX_CLASSES} classes")
        if not -2**63 <= self.seed < 2**63:
            raise GemsError(f"--seed must fit in 64 bits (-2**63 to 2**63-1), got {self.seed}")
        from gems.partition.backward import split_mode  # noqa: PLC0415 - the planner's parser, once
        split_mode(self.split_backward)
        if self.spatial != "auto":   # gems-train's auto is resolved on the launched ranks (gems.train.planning)
            self.tiles()   # P or RxC
        if self.steps is not None and self.epochs is not None:
            raise GemsError("give either --steps or --epochs, not both")
        if (self.steps is not None and self.steps < 1) or (self.epochs is not None and self.epochs < 1):
            raise GemsError("--steps and --epochs must be at least 1")
        model_kwargs(self.model_arg)
        if self.init_exclude and not self.init_from:
            raise GemsError("--init-exclude needs --init-from, the file whose other keys are loaded")
        if self.resume and not self.checkpoint_dir:
            raise GemsError("--resume needs --checkpoint-dir to find the checkpoint in")
        if (self.checkpoint_every or self.keep_checkpoints) and not self.checkpoint_dir:
            raise GemsError("--checkpoint-every and --keep-checkpoints need --checkpoint-dir")
        if min(self.checkpoint_every, self.keep_checkpoints, self.warmup_steps, self.workers) < 0:
            raise GemsError("--checkpoint-every, --keep-checkpoints, --warmup-steps and --workers "
                            "cannot be negative")
        if self.plan and (self.balance or self.memory_budget or self.recompute != "none" or self.offload != "none"
                          or self.state_placement != "device"):
            raise GemsError("--plan already fixes the cut points and policies: drop --balance / --memory-budget / "
                            "--recompute / --offload / --state-placement")
        if not (0 < self.lr < math.inf and self.timeout > 0):  # also refuses nan
            raise GemsError("--lr and --timeout must be positive (and --lr finite)")
        if not (0 <= self.momentum < math.inf and 0 <= self.weight_decay < math.inf):
            raise GemsError("--momentum and --weight-decay must be finite and not negative")
        if self.clip_grad_norm is not None and not 0 < self.clip_grad_norm < math.inf:
            raise GemsError("--clip-grad-norm must be positive and finite")
        self._validate_task()
        if self.tensorboard:
            from gems.train.board import require_tensorboard  # noqa: PLC0415
            require_tensorboard()
        if self.trace_png or self.plan_png:
            from gems.obs.trace import require_matplotlib  # noqa: PLC0415
            if self.trace_png:
                require_matplotlib("--trace-png")
            if self.plan_png:
                require_matplotlib("--plan-png", "a plan")

    def _validate_task(self) -> None:
        if self.val_every < 0 or (self.val_batch_size is not None and self.val_batch_size < 1):
            raise GemsError("--val-every cannot be negative and --val-batch-size must be at least 1")
        if (self.val_every or self.val_batch_size) and not self.val_data:
            raise GemsError("--val-every and --val-batch-size need --val-data, the images to validate on")
        if self.keep_best and not (self.val_data and self.checkpoint_dir):
            raise GemsError("--keep-best needs --val-data (to measure) and --checkpoint-dir (to keep it in)")
        if self.task == "classification" and (self.ignore_index is not None or self.binary_masks):
            raise GemsError("--ignore-index and --binary-masks are for masks: add --task segmentation")
        if not 0 <= self.label_smoothing < 1:
            raise GemsError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.lr_schedule == "step":
            if not self.lr_milestones:
                raise GemsError("--lr-schedule step needs --lr-milestones, e.g. --lr-milestones 3000,6000")
            self.milestones()
            if not 0 < self.lr_gamma < math.inf:
                raise GemsError(f"--lr-gamma must be positive, got {self.lr_gamma}")
        elif self.lr_milestones:
            raise GemsError("--lr-milestones needs --lr-schedule step")
        self.weights()

    def milestones(self) -> list[int]:
        """--lr-milestones as increasing step numbers."""
        try:
            steps = [int(x) for x in (self.lr_milestones or "").split(",") if x.strip()]
        except ValueError:
            steps = []
        if not steps or steps != sorted(set(steps)) or steps[0] < 1:
            raise GemsError(f"--lr-milestones takes increasing positive steps like 3000,6000, got "
                            f"{self.lr_milestones!r}")
        return steps

    def weights(self) -> list[float] | None:
        """--class-weights as floats (None when not given)."""
        if self.class_weights is None:
            return None
        try:
            weights = [float(x) for x in self.class_weights.split(",")]
        except ValueError:
            raise GemsError(f"--class-weights takes comma-separated numbers like 0.2,1,1, got "
                            f"{self.class_weights!r}") from None
        return weights


def tile_count(spatial: str | None, tool: str) -> int:
    """P of ``--spatial`` P or RxC (1 without it); GemsError for anything else, auto included: the
    ranks must be placed before the plan is made."""
    if spatial is None:
        return 1
    from gems.partition.spatial import parse_spatial  # noqa: PLC0415 - the planner's parser, once

    value = parse_spatial(spatial)
    if value == "auto":
        raise GemsError(f"{tool} needs the tile count before planning: pass --spatial P or RxC (gems-plan "
                        "--spatial auto finds one)")
    return value if isinstance(value, int) else value[0] * value[1]
