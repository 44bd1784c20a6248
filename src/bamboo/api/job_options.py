"""`bamboo.Job(...)`'s typed signature: every option with its type, default and help.

GENERATED from the options' declaration (bamboo.config.sections) by
`python -m bamboo.api.gen_job_options`: do not edit; rerun it after changing an option. `Job`
(bamboo.api.job) takes its `__init__` from `JobOptions`; the call goes to `Job._build` with
only the options given (bamboo.api.keywords). No `from __future__ import annotations`:
`help()` shows the annotations as types, not as strings.
"""
from collections.abc import Callable, Mapping, Sequence
from os import PathLike
from typing import TYPE_CHECKING, Any, Literal

from bamboo.api.keywords import given_only
from bamboo.config import KillSpec

if TYPE_CHECKING:
    from torch.nn import Module

    from bamboo.model.api import PipelineModel

__all__ = ["JobOptions"]


class JobOptions:
    """The signature of `bamboo.Job`: the model, its data, loss and optimizer, and every
    option `bamboo train` takes as a flag."""

    @given_only("_build")
    def __init__(
        self,
        model: "str | Callable[..., Any] | PipelineModel | Module | Sequence[Any] | None" = None,
        dataset: Any = None,
        loss: Callable[..., Any] | str | None = None,
        optimizer: Callable[..., Any] | str | None = None,
        schedule: Callable[..., Any] | str | None = None,
        eval_dataset: Any = None,
        *,
        # -- model --
        precision: Literal['fp32', 'bf16', 'fp16'] = 'fp32',
        activation_checkpointing: bool = False,
        # -- data --
        data: str | PathLike[str] | None = None,
        collate: Callable[..., Any] | str | None = None,
        # -- layout --
        nodes: int = 4,
        stages: int | Literal['auto'] = 4,
        pipelines: int | None = None,
        micro_batches: int = 4,
        micro_batch_size: int = 8,
        global_batch_size: int | None = None,
        memory_per_node: str | None = None,
        host_memory_per_node: str | None = None,
        layer_costs: str | PathLike[str] | None = None,
        pipeline_schedule: Literal['1f1b', 'zb-h1'] = '1f1b',
        # -- training --
        steps: int = 50,
        seed: int = 0,
        lr: float = 0.003,
        warmup_steps: int = 5,
        weight_decay: float = 0.01,
        grad_clip: float = 1.0,
        exact: bool = False,
        metrics: Mapping[str, Callable[..., Any]] | Sequence[str] | str = (),
        # -- redundancy --
        redundancy: Literal['eager', 'lazy', 'off', 'reroute', 'auto'] = 'lazy',
        frc_at: Literal['waits', 'slot'] = 'waits',
        frc_offload: bool = False,
        recovery: Literal['redundancy', 'checkpoint-restart'] = 'redundancy',
        check_replicas: bool = False,
        # -- runtime --
        device: Literal['auto', 'cpu', 'cuda'] = 'auto',
        threads: int = 1,
        pin_cpus: Literal['off', 'auto'] = 'off',
        comm: Literal['strict', 'tagged'] = 'strict',
        bucket_mb: float = 25.0,
        comm_timeout: float = 60.0,
        lease: float = 10.0,
        # -- cluster --
        kill: KillSpec | str | Sequence[KillSpec | str] = (),
        trace: str | PathLike[str] | None = None,
        time_scale: float | None = None,
        max_nodes: int | None = None,
        boot_s: float = 0.0,
        notice_s: float | None = None,
        # -- checkpoints --
        checkpoint_every: int | None = None,
        checkpoint_dir: str | PathLike[str] | None = None,
        keep_checkpoints: int = 2,
        resume: Literal['auto'] | str | PathLike[str] | None = None,
        # -- evaluation --
        eval_every: int = 0,
        eval_batches: int = 8,
        # -- logging --
        out: str | PathLike[str] | None = None,
        tensorboard: str | PathLike[str] | None = None,
        wandb: str | None = None,
        # -- ray --
        ray: str | None = None,
        ray_resources: str | None = None,
        ray_working_dir: str | PathLike[str] | None = None,
        ray_wait_s: float = 120.0,
    ) -> None:
        """Make a training job: the model, and the options `bamboo train` takes as flags.

        Long because it lists every option, generated from their declaration.

        Options are keyword-only, named as the flag without `--`, `-` written `_`; an option
        left out keeps its default, as on the command line, and each value is checked as its
        flag's is, when the job is made (bamboo.JobError, one line). An unknown name is refused
        naming the nearest known one; an option's summary.json key is taken too (`kills`,
        `lease_s`).

        Args:
            model (str | Callable[..., Any] | PipelineModel | Module | Sequence[Any] | None):
                What is trained: a preset's name or 'MODULE:FUNCTION' (as --model: a preset
                (gpt2-tiny, gpt2-mini, gpt2-small, gpt2-medium, llama-tiny, llama-1b, bert-tiny,
                bert-mini, cnn-tiny); or a Hugging Face model: hf:gpt2, hf:llama, hf:bert,
                hf:gpt2:n_layer=4,n_embd=128, hf:DIR; or your own model: MODULE:FUNCTION or
                FILE.py:FUNCTION (docs/models.md)); a function returning a model; or the model
                itself (a PipelineModel, an nn.Sequential, a list of modules, a DeepSpeed
                PipelineModule), sent by value. Default: gpt2-tiny.
            dataset (Any): Your map-style Dataset (sample i is (inputs, labels)), a function or
                class returning one, a functools.partial of one, or 'MODULE:NAME(ARGS)' text.
                Default: bamboo's own data.
            loss (Callable[..., Any] | str | None): loss(outputs, labels) -> the micro-batch's
                mean loss: a function, a class with its arguments (functools.partial), or such
                an object. Default: the model's own.
            optimizer (Callable[..., Any] | str | None): A factory taking the parameters: a
                torch.optim class, or functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9).
                Default: AdamW.
            schedule (Callable[..., Any] | str | None): The learning-rate schedule: a function
                step -> multiplier, or a functools.partial of a torch.optim.lr_scheduler class.
                Default: warm-up, then cosine decay.
            eval_dataset (Any): The held-out Dataset for eval_every, in the forms dataset takes.
            precision (Literal['fp32', 'bf16', 'fp16'], default 'fp32'): fp32 | bf16 | fp16:
                bf16 and fp16 run forward and backward under autocast with half-precision
                compute; weights, gradients and optimizer state stay fp32. fp16 (V100, T4: GPUs
                without bf16) scales the loss dynamically, as torch.amp.GradScaler does; a step
                whose gradients overflow is skipped on every node. (--precision)
            activation_checkpointing (bool, default False): Recompute each layer's activations
                in the backward instead of keeping them. (--activation-checkpointing)
            data (str | PathLike[str] | None, default None): A directory written by `bamboo data
                prepare` (token files; the model's vocabulary follows its tokenizer's), or a
                UTF-8 text file to train on as byte tokens; default: a synthetic language.
                (--data)
            collate (Callable[..., Any] | str | None, default None): How --dataset's samples
                make a micro-batch (default: torch's default_collate). (--collate)
            nodes (int, default 4): Worker processes to start; nodes beyond pipelines x stages
                are standbys. (--nodes)
            stages (int | Literal['auto'], default 4): Pipeline stages P; auto: the fewest whose
                stage fits a node's memory (with its replica where the redundancy mode keeps
                one), with as many pipelines as the nodes and the global batch allow (the choice
                and why on stderr). (--stages)
            pipelines (int | None, default None): Data-parallel pipelines D; default nodes //
                stages. (--pipelines)
            micro_batches (int, default 4): Micro-batches per pipeline per step at the start
                (M); the global batch is D x M; with --global-batch-size, S / (D x B).
                (--micro-batches)
            micro_batch_size (int, default 8): Samples per micro-batch (B). (--micro-batch-size)
            global_batch_size (int | None, default None): Samples per step, kept by every later
                layout: sets --micro-batches to S / (D x B); with --stages auto the layout is
                chosen for it (default there: --micro-batches x --micro-batch-size).
                (--global-batch-size)
            memory_per_node (str | None, default None): The memory one node may use, e.g. 64MiB
                or 16GiB: --stages auto picks the fewest stages whose share of the model fits
                it; default this machine's memory shared by its local workers.
                (--memory-per-node)
            host_memory_per_node (str | None, default None): The host memory one node may use
                for what it keeps off its accelerator (lazy redundancy's replica): with it
                --stages auto counts that replica against it, not against --memory-per-node;
                default on a GPU this machine's memory shared by its local workers; on CPU nodes
                the two are one memory, so both count against --memory-per-node.
                (--host-memory-per-node)
            layer_costs (str | PathLike[str] | None, default None): A file of measured seconds
                per layer (`bamboo profile --layers-only`): stages are cut by those instead of
                by parameter counts. (--layer-costs)
            pipeline_schedule (Literal['1f1b', 'zb-h1'], default '1f1b'): 1f1b | zb-h1: the
                pipeline schedule. zb-h1 splits each backward into the input gradient and the
                weight gradient and defers the weight gradients into what 1F1B leaves idle (Zero
                Bubble, ICLR'24), with at most 1F1B's peak of micro-batches in flight on every
                stage; each linear layer's input is kept until its weight gradient. (--schedule)
            steps (int, default 50): Optimizer steps to run. (--steps)
            seed (int, default 0): Seeds the model's parameters and the data. (--seed)
            lr (float, default 0.003): Peak learning rate (AdamW). (--lr)
            warmup_steps (int, default 5): Linear warm-up steps, then cosine decay to lr / 10 at
                the last step. (--warmup-steps)
            weight_decay (float, default 0.01): Decoupled weight decay on matrices.
                (--weight-decay)
            grad_clip (float, default 1.0): Clip the global gradient norm (over all stages) to
                this; 0 disables. (--grad-clip)
            exact (bool, default False): Accumulate and reduce gradients in float64 in pipeline
                order, so every layout gives the same bits (slower; the default accumulates in
                fp32 and reduces with one collective). (--exact)
            metrics (Mapping[str, Callable[..., Any]] | Sequence[str] | str, default ()): A
                metric of the last stage (repeatable): FUNCTION(outputs, labels) -> scalar,
                averaged over the global batch (summary.json's metrics, the live line,
                TensorBoard, W&B, /metrics). (--metric)
            redundancy (Literal['eager', 'lazy', 'off', 'reroute', 'auto'], default 'lazy'):
                lazy | eager | off: how a node prepares to take over its successor's stage. lazy
                (the default) keeps its successor's layers and optimizer state, and redoes that
                stage's forwards only when it takes over; eager also runs them every step (free
                only where a pipeline bubble and a processor of its own hold them: M <= 3(P-1));
                reroute (D >= 2): no replicas, a lost stage's micro-batches go to its
                data-parallel peers; auto: chosen at every generation from the preemption rate
                and the costs measured in the run. (--redundancy)
            frc_at (Literal['waits', 'slot'], default 'waits'): waits | slot: where eager FRC
                runs. waits: while the node waits for a transfer, one redundant forward at a
                time, and what is left before the commit round; slot: right after its input is
                ready, whether the node would wait there or not. (--frc-at)
            frc_offload (bool, default False): Keep what eager FRC saves for a later backward in
                CPU memory until a failover needs it (bounds GPU memory). (--frc-offload)
            recovery (Literal['redundancy', 'checkpoint-restart'], default 'redundancy'):
                redundancy | checkpoint-restart. The second is the baseline Bamboo is measured
                against: every preemption restarts all workers from the last checkpoint (as
                torchrun does); it implies --redundancy off and needs checkpoints (not
                --checkpoint-every 0). (--recovery)
            check_replicas (bool, default False): Compare every replica's digest with its
                primary's after every step. (--check-replicas)
            device (Literal['auto', 'cpu', 'cuda'], default 'auto'): auto | cpu | cuda (cuda
                uses NCCL, one GPU per local worker). (--device)
            threads (int, default 1): torch threads per worker process. (--threads)
            pin_cpus (Literal['off', 'auto'], default 'off'): off | auto: with auto, when this
                machine has at least as many cores as local workers, each local worker is pinned
                to cores of its own (os.sched_setaffinity) and its torch threads set to their
                number. (--pin-cpus)
            comm (Literal['strict', 'tagged'], default 'strict'): strict | tagged. strict (the
                default) keeps NCCL's rules on every backend: no tags (transfers between two
                nodes are matched by the order they are posted), exchanges in both directions as
                one batch, and every loss handled by dropping the process group and forming a
                new one among the survivors. tagged (gloo only) keeps transfers apart by tags on
                a group that outlives lost peers. (--comm)
            bucket_mb (float, default 25.0): The data-parallel gradient sums go in buckets of
                about this many MB (DDP's bucket_cap_mb), a stage's last layers first; in steady
                steps each is launched as soon as the stage's last backward of the step has
                produced it, overlapping the rest of that backward (zb-h1: after the last weight
                gradient; a re-routed stage: at the commit round); 0: one bucket per stage, at
                the round. (--bucket-mb)
            comm_timeout (float, default 60.0): Timeout of every point-to-point and collective
                call. (--comm-timeout)
            lease (float, default 10.0): A node whose heartbeat is older than this is fenced
                (SIGKILL) and handled as lost; more than the 0.5 s between two heartbeats.
                (--lease)
            kill (KillSpec | str | Sequence[KillSpec | str], default ()): Preemptions to inject
                (repeatable): "D:S@K" SIGKILLs the holder of stage S of pipeline D in step K;
                "D:S@K+notice" sends a notice (SIGTERM) first. (--kill)
            trace (str | PathLike[str] | None, default None): A preemption trace to replay on
                the local cluster (Bamboo CSV, count rows, JSON rows). (--trace)
            time_scale (float | None, default None): Trace seconds per wall second when
                replaying a --trace (default 360). (--time-scale)
            max_nodes (int | None, default None): At most this many workers alive at once
                (default: --nodes). (--max-nodes)
            boot_s (float, default 0.0): Trace seconds a new instance takes to boot: when a slot
                under --max-nodes frees, a live trace node without a worker takes it this long
                after (EC2 takes about 45-90 s; 0: at once). (--boot-s)
            notice_s (float | None, default None): Preemption notice before each kill (trace
                removes and +notice kills), wall seconds. (--notice-s)
            checkpoint_every (int | None, default None): Save a durable checkpoint every K
                steps, on every preemption notice and after the last step (0: never). Default:
                chosen by the run: the first after step 2, then every sqrt(2 x write cost x mean
                time between losses no redundancy covers) (Young/Daly), at most 1% of step time
                spent writing and never more than 3 minutes of training unprotected. Used only
                when no live node holds some layer any more, and by --resume.
                (--checkpoint-every)
            checkpoint_dir (str | PathLike[str] | None, default None): Where the nodes write
                checkpoints and the final layers: an absolute path or a URL (fsspec: s3://...,
                gs://..., file:///...) that every machine reaches at the same address; default
                RUN_DIR/checkpoints. (--checkpoint-dir)
            keep_checkpoints (int, default 2): Whole checkpoints kept; older ones are pruned
                after a newer one is published. (--keep-checkpoints)
            resume (Literal['auto'] | str | PathLike[str] | None, default None): Continue the
                run whose directory (or checkpoints/ folder) this is; auto: the --out
                directory's run when it has a whole checkpoint, else a fresh start (one command
                line for the first start and every restart). (--resume)
            eval_every (int, default 0): Every K steps (and after the last), the held-out loss
                on the val split (eval_losses in summary.json); 0: never. (--eval-every)
            eval_batches (int, default 8): Val micro-batches (of --micro-batch-size windows
                each) in one evaluation. (--eval-batches)
            out (str | PathLike[str] | None, default None): Run directory (summary.json,
                events.jsonl, report, checkpoints); default runs/<timestamp>. (--out)
            tensorboard (str | PathLike[str] | None, default None): Write TensorBoard event
                files to this directory (tensorboard --logdir DIR). (--tensorboard)
            wandb (str | None, default None): Log the same scalars to this Weights & Biases
                project (WANDB_MODE=offline works without network). (--wandb)
            ray (str | None, default None): Run the nodes as actors on the Ray cluster at
                ADDRESS (HOST:PORT of its head; auto: RAY_ADDRESS or the head running on this
                machine). One actor per node, placed by Ray; a Ray node lost is a preemption, a
                drain a notice. (--ray)
            ray_resources (str | None, default None): What one node asks of Ray, e.g.
                CPU=4,GPU=1 or CPU=1,spot=1 (default: GPU=1 where the cluster has GPUs, else
                CPU=1). (--ray-resources)
            ray_working_dir (str | PathLike[str] | None, default None): The directory Ray ships
                to every node for the job's code: its modules import there (default: none;
                objects sent by value travel with the job). (--ray-working-dir)
            ray_wait_s (float, default 120.0): How long to wait for Ray to place the first nodes
                (or to replace lost ones) before stopping, naming what is missing (default 120).
                (--ray-wait-s)
        """
