"""Trainer actors: data-parallel Learners plus, on rank 0, the weight sender and evaluation.

`TrainerActor` is a thin Ray shell around a learner of `algorithms/` (the one `algorithm.name` registers). Trainers form their own process group
(gloo on CPU, NCCL on CUDA) for the gradient all-reduce; the weight-sync group with the rollout
actors is a separate one (async_flowgrpo.sync), so the two never interfere.

Two data-parallel layouts (trainer.fsdp): replicated weights with one flat gradient all-reduce, or
the transformer sharded with FSDP2 (async_flowgrpo.fsdp). Sharded, the calls that need whole
weights (push, evaluate, digest, checkpoint) are collective: the driver calls them on every rank
(`driver.cluster.Cluster.on_trainers`) and rank 0 answers.

With trainer.sequence_parallel = N (async_flowgrpo.seqpar), either layout gets a sequence axis: each N
consecutive ranks receive the same shard, split its tokens, and sum their gradients; evaluation is
then collective too (the sequence groups split the prompts; a group's ranks generate its prompts
together and each scores a share).

Trajectories arrive by reference: `train_step` gets the object refs of its shard's groups and
the advantages the driver computed from their rewards, and fetches the groups from Ray's object
store itself, so latents never pass through the driver.

Staged state (replicated weights, rank 0): after each update (and at start and resume) the state a
checkpoint holds is copied to host memory, tagged with the version it makes. A stop that cannot
wait for the update in flight (longer than trainer.stop_grace_s) checkpoints that copy, read on
the "control" thread while the update runs (`staged_state`, `save_staged_weights`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import ray
import torch
import torch.distributed as dist

from async_flowgrpo import seqpar
from async_flowgrpo.actors import quiet_actor_output
from async_flowgrpo.builders import build_learner, set_cpu_threads
from async_flowgrpo.conditioning import SOURCE_IMAGES, side_by_side
from async_flowgrpo.config import Config
from async_flowgrpo.ema import WeightAverage
from async_flowgrpo.gpu_monitor import GpuMonitor
from async_flowgrpo.metrics import BusyTracker
from async_flowgrpo.sync import rendezvous_store

logger = logging.getLogger(__name__)


@ray.remote(concurrency_groups={"control": 1})
class TrainerActor:
    """Training, weight pushes, evaluation and checkpoints run one at a time on the default thread;
    the driver's counter reads ("control") answer at once, even during a training step."""

    def __init__(self, cfg: Config, rank: int, world_size: int, dp_address: tuple[str, int], transport):
        quiet_actor_output(cfg.trainer.output_dir, f"trainer-{rank}", cfg.logging.actor_output == "file")
        set_cpu_threads(cfg.trainer.cpus_per_worker)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.sharded = cfg.trainer.fsdp
        self.sequence_parallel = cfg.trainer.sequence_parallel
        # a sequence group's ranks draw the same random numbers (DiffusionNFT's noise): seeded by data rank
        torch.manual_seed(cfg.trainer.seed + seqpar.data_rank(rank, self.sequence_parallel))
        if world_size > 1 or self.sharded:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            host, port = dp_address  # listening on this address only (loopback on one node)
            store = rendezvous_store(host, port, rank, world_size, cfg.ray.start_timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        # the ranks of a sequence group agree on the groups they keep (_fetch)
        self.sequence_group = seqpar.sequence_group(self.sequence_parallel) if self.sequence_parallel > 1 else None
        # replicated: one flat all-reduce; FSDP reduce-scatters gradients itself (seqpar.grad_reduce)
        reduce = seqpar.grad_reduce(world_size, self.sequence_parallel, self.sharded)
        self.learner = build_learner(cfg, grad_all_reduce=reduce)
        self.ema = self._new_average()
        self.sender = transport.sender() if rank == 0 else None
        self.gpu = GpuMonitor().start()  # perf/gpu_util on NVIDIA GPUs; nothing elsewhere
        self.busy = BusyTracker()  # perf/trainer_idle_frac
        # the last batch's first images and captions (and the grid's nrow, sources beside results), on rank 0
        self.samples: tuple | None = None
        self.stopping = threading.Event()  # the run is stopping: evaluations are abandoned (set on "control")
        self.staged: tuple[int, dict] | None = None  # (version, state_dict()) of the last completed update
        self.staged_is_current = False  # no update has touched the weights since the staged copy
        self._stage(0)

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    # -- training ----------------------------------------------------------------------------
    def train_step(self, shard: list[tuple[list, torch.Tensor]], version: int) -> dict[str, float]:
        """shard: ([object ref of a Group], its advantages) per group; the refs are wrapped in a list
        so that Ray hands them over unresolved and this actor fetches them."""
        with self.busy.busy():
            self.staged_is_current = False  # (an update that raises leaves it so)
            start = time.perf_counter()
            groups, lost = self._fetch(shard)
            fetch_s = time.perf_counter() - start
            metrics = self.learner.train_step(groups, version) if groups else {}
            if self.ema is not None and metrics.get("samples/trained", 0) > 0:  # not after a skipped (NaN) update
                self.ema.update()
            time.sleep(max(0.0, self.cfg.trainer.min_step_time_s - (time.perf_counter() - start)))  # a paced trainer
            self._stage(version + 1)  # (after the pacing, which stands for a long update)
        if self.rank == 0 and groups:
            images, prompts = torch.cat([g.images for g in groups]), [g.prompt for g in groups for _ in range(g.size)]
            sources = [g.metadata.get(SOURCE_IMAGES) for g in groups for _ in range(g.size)]
            if sources[0] is None:
                self.samples = (images[:32], prompts[:32])
            else:  # an edit or image-to-video: each input beside its result
                grid = side_by_side(images[:16], sources[:16], prompts[:16])
                self.samples = (grid["images"], grid["captions"], grid["nrow"])
        return {**metrics, "perf/trainer_fetch_s": fetch_s, "samples/lost": lost, **self.gpu.read()}

    def _fetch(self, shard: list[tuple[list, torch.Tensor]]) -> tuple[list, int]:
        """The shard's groups with their advantages set, and the number of samples lost: in
        fully_async a group lives in its rollout actor's object store until trained, and dies with it.
        Collective with several trainers, as the ranks fetch at different moments: the ranks of a
        sequence group keep the same groups (they split the same rows), and when a data rank is left
        with fewer samples than trainer.mini_batches (it could not join the update's gradient
        all-reduces) no rank trains: their groups count as lost too."""
        timeout = self.cfg.ray.call_timeout_s
        try:
            groups = ray.get([ref[0] for ref, _ in shard], timeout=timeout)
        except ray.exceptions.ObjectLostError:
            groups = []
            for ref, _ in shard:
                try:
                    groups.append(ray.get(ref[0], timeout=timeout))
                except ray.exceptions.ObjectLostError as e:
                    logger.warning("group lost before training (%s): %s", type(e).__name__, str(e).splitlines()[0][:300])
                    groups.append(None)
        device = self.learner.policy.device
        keep = [g is not None for g in groups]
        if self.sequence_group is not None:
            keep = seqpar.all_true(keep, device, self.sequence_group)
        kept, lost = [], 0
        for group, keep_it, (_, advantages) in zip(groups, keep, shard):
            if not keep_it:
                lost += advantages.numel()
                continue
            group.advantages = advantages
            kept.append(group)
        if self.world_size > 1:
            enough = sum(g.size for g in kept) >= self.cfg.trainer.mini_batches
            if not seqpar.all_true([enough], device)[0]:
                logger.warning("a trainer lost too many groups to train this step: no trainer trains it")
                lost += sum(g.size for g in kept)
                kept = []
        return kept, lost

    @ray.method(concurrency_group="control")
    def sample_images(self) -> tuple | None:
        """Rank 0: the first images of the last trained batch and their prompts (run outputs):
        the arguments of RunLogger.log_images after its step and name."""
        return self.samples

    @ray.method(concurrency_group="control")
    def idle_fraction(self) -> float:
        return self.busy.idle_frac()

    # -- whole weights: rank 0's, gathered from every rank when sharded -------------------------
    def _trainable_state(self, sampling: bool = False) -> dict[str, torch.Tensor]:
        """Collective when sharded (every rank must call); rank 0 gets the weights, others {}.
        sampling: the weights rollout actors sample with (DiffusionNFT: its old copy), not the trained ones."""
        state = self.learner.sampling_state() if sampling else self.learner.policy.trainable_state()
        if not self.sharded:
            return state
        from async_flowgrpo import fsdp  # here, not at the top: the driver imports this module, and fsdp costs it 0.8 s

        return fsdp.gather(state.items(), keep=self.rank == 0)

    def sync_address(self, host: str | None = None):
        return self.sender.new_address(host)

    def sync_connect(self, address, world_size: int) -> None:
        self.sender.connect(address, world_size)

    def push(self, version: int):
        with self.busy.busy():
            state = self._trainable_state(sampling=True)
            return self.sender.send(state, version) if self.rank == 0 else None

    def weights_digest(self) -> str | None:
        """The published (sampling) weights: every replicated rank hashes its own copy; sharded, rank 0
        hashes the gathered weights."""
        from async_flowgrpo.sync import digest

        state = self._trainable_state(sampling=True)
        return None if self.sharded and self.rank != 0 else digest(state)

    # -- evaluation and checkpoints ------------------------------------------------------------
    def _new_average(self) -> WeightAverage | None:
        decay = self.cfg.trainer.ema_decay
        return WeightAverage(self.learner.policy.trainable_state(), decay) if decay > 0 else None

    def _evaluated_weights(self):
        """What evaluation and saved weights use: the weight average when on, else the live weights."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    @ray.method(concurrency_group="control")
    def stop_evaluating(self) -> None:
        """The run is stopping: the evaluation in progress ends at its next denoising step, and any
        later one at once, so that the stop's checkpoint, queued behind it, is written within the
        grace period. For good: a stopping run evaluates nothing more."""
        self.stopping.set()

    def evaluate(self, step: int) -> dict | None:
        """Sharded or sequence-parallel, the ranks split the prompts (collective; a sequence group's
        ranks generate theirs together and each scores a share); rank 0 returns the result. None
        when abandoned (stop_evaluating)."""
        from async_flowgrpo import fsdp
        from async_flowgrpo.evaluation import EvaluationCut, evaluate_policy

        try:
            with self._evaluated_weights():
                if not self.sharded and self.sequence_parallel == 1:
                    return evaluate_policy(self.learner.policy, self.cfg, interrupted=self.stopping.is_set)
                try:  # the ranks' forward passes are collective: they abandon it together
                    return evaluate_policy(self.learner.policy, self.cfg, self.rank, self.world_size, self.stopping.is_set,
                                           sequence_parallel=self.sequence_parallel)
                finally:
                    if self.sharded:
                        for transformer in self.learner.policy.transformers():
                            fsdp.reshard(transformer)
        except EvaluationCut:
            return None

    def state_dict(self) -> dict | None:
        ema = {}
        if self.staged_is_current:  # a checkpoint right after an update: that update's copy, not a second one
            return {**self.staged[1], "rng": torch.get_rng_state()}
        if not self.sharded:
            if self.ema is not None:
                ema = {"ema": self.ema.state_dict()}
            return {**self.learner.state_dict(), "rng": torch.get_rng_state(), **ema}
        from async_flowgrpo import fsdp

        transformer = self.learner.policy.adapter.transformer
        trainable = self._trainable_state()
        optimizer = fsdp.optimizer_state(transformer, self.learner.optimizer)  # keyed by name, any world size
        if self.ema is not None:
            ema = {"ema": {"average": fsdp.gather(self.ema.average.items(), keep=self.rank == 0), "updates": self.ema.updates}}
        state = {"trainable": trainable, "optimizer": optimizer, "steps": self.learner.steps, "rng": torch.get_rng_state()}
        return {**state, **ema} if self.rank == 0 else None

    def load_state_dict(self, state: dict, version: int = 0) -> None:
        """Every rank gets the same whole state (sharded: each keeps its shards); `version`: the
        checkpoint's, which the staged copy of this state carries."""
        if self.sharded:
            from async_flowgrpo import fsdp

            fsdp.load_state(self.learner.policy.adapter.transformer, self.learner.optimizer, state["trainable"], state["optimizer"])
            self.learner.steps = state.get("steps", 0)
        else:
            self.learner.load_state_dict(state)
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        self.ema = self._new_average()  # without a saved one (a run that turned it on): from the loaded weights
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        self._stage(version)

    # -- the staged state: what a stop saves without waiting for the update in flight -----------
    def _stage(self, version: int) -> None:
        """Keep a host copy of the state after `version` updates (state_dict's copy: the previous one
        is dropped once this one is whole, so a reader never sees half of one). Rank 0 of replicated
        weights only: sharded, the state is gathered collectively, which an update in flight blocks."""
        if self.rank == 0 and not self.sharded:
            self.staged_is_current = False
            self.staged = (version, self.state_dict())
            self.staged_is_current = True

    @ray.method(concurrency_group="control")
    def staged_state(self) -> tuple[int, dict] | None:
        """(version, state) of the last completed update, answered at once during an update; None
        when not staged (sharded weights)."""
        return self.staged

    @ray.method(concurrency_group="control")
    def save_staged_weights(self, path: str, version: int) -> bool:
        """`save_weights` from the staged state of `version` (the live weights may be mid-update):
        LoRA in the family's format; a full fine-tune's transformer as config + safetensors. A
        two-expert full fine-tune's weights are left to the next regular checkpoint. False, and
        nothing written, when the update has ended since the driver read `version`'s state: the
        staged copy is then the next version's."""
        staged_version, state = self.staged
        if staged_version != version:
            return False
        weights = state["ema"]["average"] if "ema" in state else state["trainable"]  # what save_weights saves
        policy = self.learner.policy
        if policy.lora_rank > 0:
            policy.adapter.save_lora(path, weights)
        elif len(policy.adapter.trained_components()) == 1:
            self._save_full(path, weights)
        return True

    def _save_full(self, path: str, weights: dict[str, torch.Tensor]) -> None:
        """A full fine-tune's transformer from `weights` (its parameters, by name) and the live
        module's buffers, which training leaves alone: loadable by `from_pretrained`."""
        from safetensors.torch import save_file

        transformer = self.learner.policy.adapter.transformer
        out = os.path.join(path, "transformer")
        buffers = {k: v.cpu() for k, v in transformer.state_dict().items() if k not in weights}  # e.g. pos_embed
        transformer.save_config(out)
        save_file({k: v.contiguous() for k, v in {**weights, **buffers}.items()},
                  os.path.join(out, "diffusion_pytorch_model.safetensors"))

    def save_weights(self, path: str) -> None:
        """LoRA: diffusers/peft format, loadable by `pipe.load_lora_weights(path)`; full: the transformer
        directory (config + safetensors), loadable by `from_pretrained`; a two-expert model's second
        expert beside it, as transformer_2 (see models/wan.py). The weight average when on."""
        with self._evaluated_weights():
            self._save_weights(path)

    def _save_weights(self, path: str) -> None:
        policy = self.learner.policy
        state = self._trainable_state()
        if self.rank != 0:
            return
        os.makedirs(path, exist_ok=True)
        if policy.lora_rank > 0:
            policy.adapter.save_lora(path, state)  # each family's own LoRA format (Wan2.2: one per expert)
        elif self.sharded:
            self._save_full(path, state)
        else:
            for name, module in policy.adapter.trained_components().items():  # the pipeline's layout
                module.save_pretrained(os.path.join(path, name))
