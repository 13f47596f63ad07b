"""What a training run is asked to do, checked before any worker starts. Torch-free."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minigpt.config import OP_RECOMPUTE, RECOMPUTE_MODES, GPTConfig
from minigpt.data import VOCAB_SIZE, BatchLayout, mixture_shares
from minigpt.tokenizer import BYTES, load_tokenizer
from minigpt.errors import (
    ConfigError, check_output_path, check_path_given, check_positive_int, check_seed, check_threads_per_rank,
)
from job.muon import OPTIMIZERS
from job.schedule import ScheduleConfig, chunk_layers
from precision.policy import POLICIES

DEVICES = ("auto", "cpu", "cuda")


def check_vocabulary(model: GPTConfig, tokenizer: str, eod: int | None = None) -> None:
    """The model's vocabulary holds every id of the tokenizer (a tokenizer.json that does not parse: ConfigError),
    and the end-of-document id `eod` where one is given."""
    if eod is not None and not (isinstance(eod, int) and 0 <= eod < model.vocab_size):
        raise ConfigError(f"the end-of-document id {eod!r} is not one of the model's {model.vocab_size} ids")
    if not isinstance(tokenizer, str):
        raise ConfigError(f"tokenizer must be {BYTES!r} or a tokenizer.json's path, got {tokenizer!r}")
    size, name = (VOCAB_SIZE, "the byte vocabulary") if tokenizer == BYTES else \
        (load_tokenizer(tokenizer).vocab_size, f"the vocabulary of tokenizer {tokenizer!r}")
    if model.vocab_size < size:
        raise ConfigError(f"vocab_size={model.vocab_size} is smaller than {name} ({size}): use --vocab-size "
                          f"{size} or more")


MIB = 2**20


def bucket_numel(bucket_mb: float, element_bytes: int) -> int:
    """Elements of a gradient bucket of `bucket_mb` MiB (DDP's bucket_cap_mb) holding `element_bytes`-byte
    elements, at least one: the one conversion the executor's ZeRO and the simulator share."""
    return max(1, int(bucket_mb * MIB) // element_bytes)


PRECISIONS = tuple(POLICIES)
def check_train_recompute(recompute: str) -> None:
    """minigpt/config.py's RECOMPUTE_MODES are what training runs; torchtitan's op policy is simulated only."""
    if recompute == OP_RECOMPUTE:
        raise ConfigError(f"--recompute {recompute} is simulated only (minigpt simulate --recompute {recompute}); "
                          "training recomputes none, selective (the attention core) or full (every block)")
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"--recompute must be {', '.join(RECOMPUTE_MODES[:-1])} or {RECOMPUTE_MODES[-1]}, "
                          f"got {recompute!r}")


def check_tensor_parallel(model: GPTConfig, tp: int, sequence_parallel: bool) -> None:
    """Everything about a tensor-parallel layout that the shape decides."""
    if model.n_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the {model.n_heads} attention heads: choose a tp that divides them")
    if model.kv_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the {model.kv_heads} key/value heads: tensor parallelism splits "
                          f"whole key/value heads across ranks (replicating them is not supported); choose a tp that "
                          f"divides them")
    if model.d_ff % tp:
        raise ConfigError(f"--tp {tp} does not divide the MLP width {model.d_ff}: choose a tp that divides it")
    if sequence_parallel and model.seq_len % tp:
        raise ConfigError(
            f"sequence parallelism needs --tp {tp} to divide the sequence length {model.seq_len}: change one of them"
        )


CP_KINDS = ("ring", "allgather")


def check_context_parallel(model: GPTConfig, cp: int, kind: str = "ring", tp: int = 1,
                           sequence_parallel: bool = False) -> None:
    """Everything about a context-parallel layout that the shape decides: the sequence is cut into 2 x cp
    equal chunks (parallel/context/chunks.py), each rank holding two, and sequence parallelism cuts a
    rank's part further over tp."""
    check_positive_int("--cp", cp)
    if kind not in CP_KINDS:
        raise ConfigError(f"--cp-kind must be one of {', '.join(CP_KINDS)}, got {kind!r}")
    if cp == 1:
        if model.attention_softcap and model.seq_len % 2:
            raise ConfigError(f"capped attention trains blockwise over the sequence's two halves (parallel/run/"
                              f"build.py), which {model.seq_len} tokens are not: choose an even --seq-len")
        return
    if 2 * cp > model.seq_len:
        raise ConfigError(f"--cp {cp} needs 2 x cp = {2 * cp} chunks of at least one token, but the sequence has "
                          f"{model.seq_len}: choose a cp of at most {model.seq_len // 2}")
    if model.seq_len % (2 * cp):
        raise ConfigError(f"--cp {cp} cuts the sequence into 2 x cp = {2 * cp} equal chunks (the load-balanced "
                          f"causal split), which {model.seq_len} tokens are not: choose a sequence length divisible "
                          f"by {2 * cp}")
    if sequence_parallel and (model.seq_len // cp) % tp:
        raise ConfigError(f"sequence parallelism cuts each context-parallel rank's {model.seq_len // cp} tokens over "
                          f"--tp {tp}, which does not divide them: change --seq-len, --cp or --tp")


def routing_ranks(dp: int, cp: int = 1, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The ranks of a pipeline stage that route distinct tokens through one set of experts: the dp x cp data ranks
    (tp peers route the same tokens), times tp under sequence parallelism (each tp rank routes its slice,
    parallel/tensor/moe.py). The expert group is ep of them (job/exchange/experts.py's expert_places)."""
    return dp * cp * (tp if sequence_parallel else 1)


def check_expert_parallel(model: GPTConfig, ep: int, dp: int, cp: int = 1, tp: int = 1,
                          sequence_parallel: bool = False) -> None:
    """Everything about expert parallelism and a mixture of experts that the shape and layout decide: the experts
    split evenly over ep ranks, consecutive among those routing distinct tokens (job/exchange/experts.py's
    expert_places: the dp x cp data ranks, times tp under sequence parallelism); context and sequence parallelism
    count MoE routing over whole sequences (parallel/context/moe.py, parallel/tensor/moe.py)."""
    check_positive_int("--ep", ep)
    if ep > 1 and not model.is_moe:
        raise ConfigError(f"--ep {ep} splits a mixture of experts over ranks, but this model is dense: give it "
                          f"experts (--experts N, or --model tiny-moe) or leave --ep at 1")
    if model.is_moe and model.n_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide the {model.n_experts} experts: each rank holds E / ep of them; "
                          f"choose an ep that divides {model.n_experts}")
    routing = routing_ranks(dp, cp, tp, sequence_parallel)
    if routing % ep:
        ranks = "dp x cp x tp" if sequence_parallel else "dp x cp"
        raise ConfigError(f"--ep {ep} does not divide the {routing} ranks that route distinct tokens ({ranks}"
                          f"{'' if sequence_parallel else '; under --sequence-parallel tp x dp x cp'}): the expert "
                          f"group is ep of them; choose an ep that divides {routing}")


def check_sharding(zero: int, data_ranks: int, shard_group: int = 0, reshard_after_forward: bool = True,
                   sync_grads_once: bool = False) -> None:
    """FSDP's settings, as training and the simulator take them (job/layout.py's Layout checks the same).

    `shard_group` N (hybrid sharding, HSDP): ZeRO shards over groups of N consecutive data ranks, replicated
    across the groups; 0: over every data rank (dp x cp). `reshard_after_forward` False: ZeRO-3 keeps a unit
    gathered from its forward to its backward (job/schedule_comm.py says how long); `sync_grads_once` with it: all
    step, its gradients summed over the micro-batches and reduce-scattered once (job/schedule_actions.py's
    ScheduleConfig.zero3_hold)."""
    for name, value in (("reshard_after_forward", reshard_after_forward), ("sync_grads_once", sync_grads_once)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    if not reshard_after_forward and zero != 3:
        raise ConfigError(f"--no-reshard-after-forward keeps ZeRO-3's gathered weights from a unit's forward to its "
                          f"backward: it needs --zero 3, not --zero {zero}")
    if sync_grads_once and (zero != 3 or reshard_after_forward):
        raise ConfigError("--sync-grads-once keeps ZeRO-3's units gathered all step and reduce-scatters their summed "
                          "gradients once: it needs --zero 3 --no-reshard-after-forward")
    if isinstance(shard_group, int) and not isinstance(shard_group, bool) and shard_group == 0:
        return  # every data rank: plain ZeRO
    check_positive_int("--shard-group", shard_group)
    if zero == 0:
        raise ConfigError(f"--shard-group {shard_group} shards ZeRO's states over groups of ranks: it needs --zero 1, "
                          f"2 or 3 (ZeRO-0 shards nothing)")
    if data_ranks % shard_group:
        divisors = [n for n in range(2, data_ranks + 1) if data_ranks % n == 0]
        raise ConfigError(f"--shard-group {shard_group} does not divide the data-parallel group of dp x cp = "
                          f"{data_ranks} ranks: choose one of {', '.join(map(str, divisors)) or 'none (one rank)'}")
    if shard_group == 1:
        raise ConfigError("--shard-group 1 shards over one rank: nothing would be sharded; give a group of 2 or more "
                          "ranks, or --zero 0")


def check_split(model: GPTConfig, tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                cp_kind: str = "ring") -> None:
    """ConfigError unless the model's shape takes this tensor- and context-parallel split (the checks above)."""
    check_tensor_parallel(model, tp, sequence_parallel)
    check_context_parallel(model, cp, cp_kind, tp, sequence_parallel)
    check_expert_parallel(model, 1, 1)


def shape_allows(model: GPTConfig, tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                 cp_kind: str = "ring") -> bool:
    """Whether the model's shape takes this tensor- and context-parallel split: check_split asked rather than
    raised (the searches of simulate, plan and calibrate skip what training would refuse)."""
    try:
        check_split(model, tp, sequence_parallel, cp, cp_kind)
    except ConfigError:
        return False
    return True


def check_trained_prediction(model: GPTConfig, split_tied: bool) -> None:
    """Multi-token prediction is trained here in every layout (`minigpt simulate` prices them all) but with a tied
    head under zero-bubble's split backward (`split_tied`: the last stage's head weight is then its lookups' too, and
    the split needs each weight in one module)."""
    if model.mtp_depth and split_tied:
        raise ConfigError(f"multi-token prediction (--mtp-depth {model.mtp_depth}) is not yet trained with a tied "
                          f"head under --schedule zb-h1: `minigpt simulate` prices it there; untie the head "
                          f"(--untied) or choose another schedule")


LR_SCHEDULES = ("cosine", "linear", "wsd", "wsd-sqrt", "constant")
WSD_SCHEDULES = ("wsd", "wsd-sqrt")  # a stable rate, then a cooldown over the last decay_fraction of the steps


@dataclass(frozen=True)
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 100
    global_batch: int = 16
    micro_batches: int = 1
    # 2e-3 and at least 10 warmup steps: 3e-3 (or 2 warmup steps in a 20-step run) spikes the tiny presets
    # within their first 20 steps, and the spike amplifies rounding differences between layouts (docs/results.md)
    lr: float = 2e-3
    min_lr: float = 2e-4
    # after the warmup: "cosine" (to min_lr at the last step), "linear" (the same, in a straight line), "wsd"
    # (warmup-stable-decay: lr until the last decay_fraction of the steps, then linearly to min_lr; Hu et al. 2024,
    # MiniCPM, arXiv 2404.06395; Hägele et al. 2024, arXiv 2405.18392, whose 20% cooldown matches cosine), "wsd-sqrt"
    # (the same with their (1 - sqrt) cooldown, lr - (lr - min_lr) sqrt(progress), which they find better than the
    # linear one) or "constant" (lr to the end)
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2
    warmup_steps: int | None = None  # None: 10% of the steps, at least 10 (at most the run), at most 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    optimizer: str = "adamw"  # one of OPTIMIZERS
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum on the matrices (Liu et al. 2025's 0.95)
    grad_clip: float = 1.0
    eval_every: int | None = None  # None: five evaluations over the run; 0: only at the end
    eval_batches: int = 4
    seed: int = 0
    data: tuple[str, ...] = ()  # text files or token directories (none: the embedded corpus; several: a mixture)
    data_weights: tuple[float, ...] = ()  # the mixture's shares, one per source (none: their training tokens')
    # the id ending each document where attention stays within documents (Llama 3's document mask; None: a sequence
    # attends across the documents packed in it)
    document_eod: int | None = None
    init_from: str | None = None  # a Hugging Face model directory whose weights the run starts from (minigpt/hf/layouts.py)
    # "bytes" or a Hugging Face tokenizer.json (minigpt/tokenizer.py): the corpus is read in its ids, which the model's
    # vocabulary must hold; a run's copy of it is out_dir/tokenizer.json
    tokenizer: str = "bytes"
    out_dir: str | None = None  # None: runs/<time>-<model shape>
    device: str = "auto"
    precision: str = "fp32"
    loss_scale: float | None = None  # fp16 only; None: dynamic scaling from 2**16, a number: static
    loss_scale_window: int = 1000  # clean steps before a dynamic scale doubles
    log_every: int | None = None  # None: about twenty log lines per run
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: each rank holds 2 of 2 x cp chunks of every sequence
    cp_kind: str = "ring"  # how the keys and values travel: "ring" (p2p, overlapped) or "allgather"
    ep: int = 1  # expert parallelism: the experts split over ep ranks routing distinct tokens
    zero: int = 0
    shard_group: int = 0  # hybrid sharding: ZeRO over groups of this many data ranks (0: all dp x cp of them)
    reshard_after_forward: bool = True  # False: ZeRO-3 keeps a unit gathered from its forward to its backward
    sync_grads_once: bool = False  # with it: kept all step, gradients summed and reduce-scattered once a step
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_chunks: int = 1
    stage_layers: tuple[int, ...] = ()  # blocks of each pipeline chunk in global chunk order; (): the even split
    bucket_mb: float = 25.0  # gradient bucket size (DDP's default)
    threads_per_rank: int | None = None  # None: torch's default for one process, 1 per rank otherwise
    save_every: int = 0  # checkpoint every N steps and at the end (0: only at the end, unless save_final is off)
    # a checkpoint after the last step, so that the run can be sampled and exported: `minigpt train` sets it
    # (unless --no-save); a run built in code (compare, claims, the tests) keeps nothing it did not ask for
    save_final: bool = False
    resume: bool = False  # continue from the latest complete checkpoint in <out_dir>/checkpoints
    recompute: str = "none"  # "selective": the attention core runs again in the backward (parallel/recompute.py)
    # seconds a rank may be silent before the run ends naming it; None: parallel/launch/watchdog.py's default, 0: off
    # (checked there, by the launcher, before any rank starts)
    watchdog_s: float | None = None
    # times torch's elastic agent starts every rank again after one fails; each restart resumes from the newest
    # checkpoint of out_dir that verifies (parallel/run/train.py's run_worker)
    max_restarts: int = 0
    # rank 0 writes TensorBoard event files into out_dir/tensorboard (parallel/run/tensorboard.py): `minigpt train`
    # sets it where the tensorboard package is installed; a run built in code (compare, claims, the tests) does not
    tensorboard: bool = False

    @property
    def saves(self) -> bool:
        """Whether the run writes checkpoints: every save_every steps, or its final one."""
        return bool(self.save_every) or self.save_final

    def saves_at(self, step: int) -> bool:
        """Whether a checkpoint is written after `step` (counted from 0)."""
        last = step == self.steps - 1
        return (self.save_every and (step + 1) % self.save_every == 0) or (last and self.saves)

    def __post_init__(self) -> None:
        positive_ints = {
            "steps": self.steps,
            "batch size": self.global_batch,
            "micro-batches": self.micro_batches,
            "eval batches": self.eval_batches,
        }
        for name, value in positive_ints.items():
            check_positive_int(name, value)
        for name in ("tp", "pp", "dp", "cp"):
            check_positive_int(f"--{name}", getattr(self, name))
        check_tensor_parallel(self.model, self.tp, self.sequence_parallel)
        check_context_parallel(self.model, self.cp, self.cp_kind, self.tp, self.sequence_parallel)
        check_expert_parallel(self.model, self.ep, self.dp, self.cp, self.tp, self.sequence_parallel)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        check_sharding(self.zero, self.data_ranks, self.shard_group, self.reshard_after_forward, self.sync_grads_once)
        if not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ConfigError(f"--bucket-mb must be a number > 0, got {self.bucket_mb}")
        if self.threads_per_rank is not None:
            check_threads_per_rank("threads per rank", self.threads_per_rank)
        BatchLayout(self.global_batch, self.micro_batches, self.dp)  # divisibility
        ScheduleConfig(self.pp, self.micro_batches, self.schedule, self.virtual_chunks, self.zero)  # checks
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # hashable, saved as a list in JSON
        chunk_layers(self.model.n_layers, self.pp * self.virtual_chunks, self.stage_layers)  # a block a chunk, or a layout
        check_train_recompute(self.recompute)
        if self.schedule == "interleaved" and self.model.n_layers % (self.pp * self.virtual_chunks) \
                and not self.stage_layers:
            raise ConfigError(
                f"interleaving needs the {self.model.n_layers} layers to divide evenly into pp x virtual chunks = "
                f"{self.pp * self.virtual_chunks} chunks: change --layers, --pp or --virtual-chunks, or place them "
                f"with --stage-layers"
            )
        check_vocabulary(self.model, self.tokenizer, self.document_eod)
        check_trained_prediction(self.model, self.model.tied_head and self.schedule == "zb-h1" and self.pp > 1)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if self.lr == 0:
            raise ConfigError("lr must be > 0")
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr {self.min_lr} is larger than lr {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not (isinstance(self.decay_fraction, (int, float)) and 0 < self.decay_fraction <= 1):
            raise ConfigError(f"decay_fraction must be a number in (0, 1], got {self.decay_fraction!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "log_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.save_every, int) or self.save_every < 0:
            raise ConfigError(f"--save-every must be an integer >= 0, got {self.save_every!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be a whole number >= 0, got {self.max_restarts!r}")
        if self.max_restarts and not self.save_every:
            raise ConfigError(f"--max-restarts {self.max_restarts} resumes from the newest checkpoint after a "
                              f"failure: give --save-every N")
        if self.max_restarts and self.world_size == 1:
            raise ConfigError(f"--max-restarts {self.max_restarts} restarts the ranks through torch's elastic agent: "
                              f"it needs a layout of more than one process")
        if self.resume and self.out_dir is None:
            raise ConfigError("--resume needs --out: the run directory whose checkpoints to continue from")
        if self.log_every is not None:
            check_positive_int("log_every", self.log_every)
        check_seed("--seed", self.seed)
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.loss_scale is not None and not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ConfigError(f"loss scale must be a finite number > 0, got {self.loss_scale}")
        check_positive_int("loss scale window", self.loss_scale_window)
        self.check_paths()

    def check_paths(self) -> None:
        check_output_path("--out", self.out_dir, "a directory path")
        if not isinstance(self.data, tuple):
            raise ConfigError(f"data must be a tuple of paths, got {self.data!r}")
        for path in self.data:
            check_path_given("--data", path, "a text file's path")
        if self.data_weights and (len(self.data) < 2 or len(self.data_weights) != len(self.data)):
            raise ConfigError(f"--data-weights gives {len(self.data_weights)} weights for {len(self.data)} --data "
                              f"source(s): give one weight per source, two sources or more")
        if self.data_weights:
            mixture_shares(self.data_weights)
        if self.out_dir is not None and Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ConfigError(f"--out {self.out_dir!r} exists and is not a directory")

    @property
    def checkpoint_dir(self) -> Path | None:
        return None if self.out_dir is None else Path(self.out_dir) / "checkpoints"

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def data_ranks(self) -> int:
        """The ranks weight gradients are averaged over (and ZeRO shards over): dp x cp."""
        return self.dp * self.cp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(100, self.steps, max(10, self.steps // 10))

    @property
    def eval_interval(self) -> int:
        """Steps between validations; the last step is always evaluated."""
        if self.eval_every is None:
            return max(1, self.steps // 5)
        return self.eval_every or self.steps

    @property
    def log_interval(self) -> int:
        return max(1, self.steps // 20) if self.log_every is None else self.log_every

    def learning_rate(self, step: int) -> float:
        """Linear warmup to lr, then lr_schedule's decay to min_lr at the last step (none: constant)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.lr_schedule == "constant":
            return self.lr
        start = self.decay_start
        progress = min(1.0, max(0, step - start) / max(1, self.steps - 1 - start))
        if self.lr_schedule == "cosine":
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
        if self.lr_schedule == "wsd-sqrt":  # Hägele et al.'s (1 - sqrt) cooldown
            return self.lr - (self.lr - self.min_lr) * math.sqrt(progress)
        return self.lr - (self.lr - self.min_lr) * progress

    @property
    def decay_start(self) -> int:
        """The step the decay starts from: the warmup's end, or under wsd the last decay_fraction of the steps
        (at least one step, never before the warmup's end)."""
        if self.lr_schedule not in WSD_SCHEDULES:
            return self.warmup
        return max(self.warmup, self.steps - max(1, round(self.decay_fraction * self.steps)))

    def as_dict(self) -> dict:
        return asdict(self)
