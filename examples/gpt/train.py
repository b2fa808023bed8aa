"""Train a tiny character-level GPT on Python's own help texts, on 2 ranks, with stratagem.

    python examples/gpt/train.py                          # 2 ranks spawned here (ddp_spawn)
    torchrun --standalone --nproc-per-node 2 examples/gpt/train.py   # ranks torchrun started
    python examples/gpt/train.py --strategy fsdp --precision bf16-mixed --checkpoint-dir out
    python examples/gpt/train.py --checkpoint-dir out --resume   # continue where out/ckpt ends

The text is every help topic of ``pydoc_data.topics`` (what ``help("for")`` shows),
concatenated in sorted key order: about 465,000 characters that ship with Python.
The model is a GPT in the usual shape (token and position embeddings, pre-norm blocks of
causal self-attention and an MLP), small enough that a run takes seconds on a CPU.

Everything below the config block is plain PyTorch; stratagem appears where a DDP script
would call its wrapper: ``strategy.wrap``, ``step``, ``backward``, ``update``, ``reduce``,
and ``sg.checkpoint.save``/``load``. `train` is importable (spawned ranks and tests import
this module), so everything a run does at the top level is under ``__main__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # the name every GPT script uses

import stratagem as sg

# -----------------------------------------------------------------------------
# config


@dataclasses.dataclass(frozen=True)
class Config:
    """Every knob of a run; the command line sets some of them (see `parse_args`)."""

    # model
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32  # context length, in characters
    dropout: float = 0.1
    bias: bool = True
    # data and optimisation
    batch_size: int = 4  # per rank and micro-batch
    gradient_accumulation_steps: int = 2  # micro-batches per optimizer step
    max_iters: int = 40
    learning_rate: float = 1e-2
    min_lr: float = 1e-3
    warmup_iters: int = 5
    lr_decay_iters: int = 40  # usually max_iters; a resumed run must keep the schedule
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0: no clipping
    # evaluation, logging, checkpoints
    eval_interval: int = 10
    eval_iters: int = 4  # batches per split and rank
    log_interval: int = 1
    checkpoint_dir: str | None = None  # save <dir>/ckpt at every evaluation
    resume: bool = False
    # system
    strategy: str = "ddp"  # ddp | fsdp
    precision: str = "32-true"  # or bf16-mixed
    compile: bool = False
    devices: int | None = None  # None: 2 spawned here, or what torchrun started
    device: str = "auto"  # a GPU per rank where there is one for each, else the CPU; or "cpu"
    seed: int = 1337
    verbose: bool = True  # rank 0 prints its progress


# -----------------------------------------------------------------------------
# data


def load_text() -> str:
    """Return every help topic that ships with Python, in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def encode_text(text: str) -> tuple[torch.Tensor, list[str]]:
    """Return the text as character indices and the vocabulary (its sorted characters)."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    return torch.tensor([stoi[ch] for ch in text], dtype=torch.long), chars


def get_batch(
    data: torch.Tensor, config: Config, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` random windows of ``data``; the targets are the inputs shifted by one."""
    ix = torch.randint(len(data) - config.block_size, (config.batch_size,), generator=generator)
    x = torch.stack([data[i : i + config.block_size] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + config.block_size] for i in ix.tolist()])
    return x, y


def stream_seed(seed: int, rank: int, stream: str) -> int:
    """Return the seed of one rank's random stream (``"train"``, ``"eval"``), from (seed, rank)."""
    digest = hashlib.sha256(f"{seed}/{rank}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Batches:
    """One rank's training batches, drawn by a generator of its own: a per-rank position.

    ``state_dict``/``load_state_dict`` make it a checkpoint entry; saved with
    ``sg.per_rank``, each rank gets its own position back on resume.
    """

    def __init__(self, data: torch.Tensor, config: Config, seed: int) -> None:
        self.data, self.config = data, config
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the next batch of windows."""
        self.drawn += 1
        return get_batch(self.data, self.config, self.generator)

    def state_dict(self) -> dict[str, Any]:
        """Return the position: the generator's state and how many batches were drawn."""
        return {"generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position `state_dict` returned."""
        self.generator.set_state(state["generator"])
        self.drawn = state["drawn"]


# -----------------------------------------------------------------------------
# model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only the positions before it."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, time, channels
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward layer: 4x wider, GELU."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A transformer block, pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer over characters."""

    def __init__(self, config: Config, vocab_size: int) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        # Not tied to wte, unlike GPT-2: one parameter per tensor keeps sharding and keys plain.
        self.lm_head = nn.Linear(config.n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled residual projections, as in GPT-2
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        assert t <= self.block_size, f"sequence of {t} is longer than block_size {self.block_size}"
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Return the next-character loss; given to ``strategy.step``, so autocast stays around it."""
    x, y = batch
    _, loss = model(x, y)
    return loss


def configure_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only (not on biases, norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2))


def get_lr(it: int, config: Config) -> float:
    """Linear warmup, then cosine decay to ``min_lr`` at ``lr_decay_iters``."""
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / (config.warmup_iters + 1)
    if it > config.lr_decay_iters:
        return config.min_lr
    ratio = (it - config.warmup_iters) / max(1, config.lr_decay_iters - config.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_lr + coeff * (config.learning_rate - config.min_lr)


# -----------------------------------------------------------------------------
# training


@torch.no_grad()
def estimate_loss(
    strategy: sg.StrategyLike,
    model: nn.Module,
    ctx: sg.Context,
    splits: dict[str, torch.Tensor],
    config: Config,
) -> dict[str, float]:
    """Return the mean loss of each split over ``eval_iters`` batches per rank and all ranks.

    The batches come from a generator seeded afresh each time, so every evaluation
    scores the same windows and leaves the training streams (and RNG) untouched.
    """
    model.eval()
    out = {}
    for split, data in splits.items():
        generator = torch.Generator().manual_seed(stream_seed(config.seed, ctx.rank, "eval"))
        losses = torch.zeros(config.eval_iters)
        for k in range(config.eval_iters):
            loss = strategy.step(model, get_batch(data, config, generator), ctx, forward=lm_loss)
            losses[k] = loss.item()
        out[f"local_{split}"] = losses.mean().item()
        out[split] = strategy.reduce(losses.mean(), "mean", ctx).item()
    model.train()
    return out


def parameters_digest(model: nn.Module) -> str:
    """Return a SHA-256 of every parameter, whole, by name (FSDP's shards are gathered)."""
    h = hashlib.sha256()
    for name, p in sg.unwrap(model).named_parameters():
        value = p.detach()
        if hasattr(value, "full_tensor"):  # a DTensor that fsdp() sharded: a collective
            value = value.full_tensor()
        h.update(name.encode())
        h.update(value.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_args(config: Config, vocab_size: int) -> dict[str, Any]:
    """Return what shapes the model, saved with each checkpoint and checked on resume."""
    names = ("n_layer", "n_head", "n_embd", "block_size", "bias")
    return {"vocab_size": vocab_size, **{name: getattr(config, name) for name in names}}


def train(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> dict[str, Any]:
    """Train on every rank; return this rank's losses, evaluations and final parameters digest.

    Returns:
        ``losses``: this rank's loss of each optimizer step run here (mean over its
        micro-batches), ``evals``: ``{"iter", "train", "val", ...}`` at each evaluation
        (means over the ranks, and this rank's own), ``digest``: a hash of the final
        parameters, ``iter_num``: where the run ended, ``data``: this rank's data position.
    """
    torch.set_num_threads(1)  # a model this small runs slower on more threads per rank
    torch.manual_seed(config.seed + ctx.rank)  # per-rank seeds: dropout differs by rank
    text_data, chars = encode_text(load_text())
    n = int(0.9 * len(text_data))
    splits = {"train": text_data[:n], "val": text_data[n:]}
    batches = Batches(splits["train"], config, stream_seed(config.seed, ctx.rank, "train"))

    plain = GPT(config, len(chars))
    # FLOPs of one micro-batch's forward and backward, counted on the plain model before wrap
    # (no collectives run; the count leaves weights and random streams as they were).
    shape = (config.batch_size, config.block_size)
    zeros = torch.zeros(shape, dtype=torch.long)
    flops = sg.step_flops(plain, (zeros, zeros), lm_loss) * config.gradient_accumulation_steps
    tokens = config.batch_size * config.block_size * config.gradient_accumulation_steps
    dtype = torch.bfloat16 if config.precision.startswith("bf16") else torch.float32
    peak = sg.peak_flops(ctx.device, dtype)  # None on the CPU: MFU is printed as n/a
    model = strategy.wrap(plain, ctx)  # rank 0's initial weights everywhere
    optimizer = configure_optimizer(model, config)  # after wrap: FSDP replaces the parameters
    iter_num, best_val_loss = 0, 1e9
    ckpt = None if config.checkpoint_dir is None else os.path.join(config.checkpoint_dir, "ckpt")
    state = {"model": model, "optimizer": optimizer, "batches": sg.per_rank(batches)}
    if config.resume:
        if ckpt is None:
            raise ValueError("resume: give the checkpoint directory to resume from")
        saved = sg.checkpoint.load(ckpt, state, ctx)  # restores every rank's RNG, too
        if saved["model_args"] != model_args(config, len(chars)):
            raise ValueError(
                f"resume: {ckpt} holds a model of {saved['model_args']}, "
                f"not {model_args(config, len(chars))}"
            )
        iter_num, best_val_loss = saved["iter_num"], saved["best_val_loss"]
        if ctx.is_main and config.verbose:
            print(f"resuming from {ckpt} at iter {iter_num}", flush=True)
    start_iter = iter_num

    losses: list[float] = []
    evals: list[dict[str, float]] = []
    t0 = time.perf_counter()
    while True:
        if iter_num % config.eval_interval == 0 or iter_num == config.max_iters:
            scores = estimate_loss(strategy, model, ctx, splits, config)
            evals.append({"iter": iter_num, **scores})
            if ctx.is_main and config.verbose:
                print(
                    f"step {iter_num}: train loss {scores['train']:.4f}, "
                    f"val loss {scores['val']:.4f}",
                    flush=True,
                )
            best_val_loss = min(best_val_loss, scores["val"])
            if ckpt is not None and iter_num > start_iter:
                checkpoint = {
                    **state,
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "model_args": model_args(config, len(chars)),
                    "config": dataclasses.asdict(config),
                }
                sg.checkpoint.save(ckpt, checkpoint, ctx)
                if ctx.is_main and config.verbose:
                    print(f"saved checkpoint to {ckpt}", flush=True)
        if iter_num >= config.max_iters:
            break

        lr = get_lr(iter_num, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # sg.accumulate divides each micro-batch's loss, skips the gradient sync on all but
        # the last, and steps the optimizer once per window; the loop calls every field.
        total = 0.0
        for _ in range(config.gradient_accumulation_steps):
            loss = strategy.step(model, batches.next(), ctx, forward=lm_loss)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
            total += loss.item()
        losses.append(total / config.gradient_accumulation_steps)

        t1 = time.perf_counter()
        dt, t0 = t1 - t0, t1
        if iter_num % config.log_interval == 0 and ctx.is_main and config.verbose:
            step = sg.rates(flops=flops, tokens=tokens, seconds=dt, peak=peak)  # this rank's
            print(
                f"iter {iter_num}: loss {losses[-1]:.4f}, lr {lr:.2e}, time {dt * 1000:.1f}ms, "
                f"{step}",
                flush=True,
            )
        iter_num += 1

    return {
        "losses": losses,
        "evals": evals,
        "digest": parameters_digest(model),
        "iter_num": iter_num,
        "data": batches.state_dict(),
    }


def build_strategy(config: Config, *, in_place: bool) -> sg.Strategy:
    """Return the strategy ``config`` asks for: spawned ranks, or ``in_place`` under torchrun."""
    if config.strategy == "ddp":
        strategy = sg.ddp(device=config.device) if in_place else sg.ddp_spawn(device=config.device)
    elif config.strategy == "fsdp":
        policy = sg.every_module_of(Block)  # one all-gather per transformer block
        options = {"shard_when": policy, "device": config.device}
        strategy = sg.fsdp(**options) if in_place else sg.fsdp_spawn(**options)
    else:
        raise ValueError(f"strategy must be 'ddp' or 'fsdp' (got {config.strategy!r})")
    if config.precision != "32-true":
        strategy = sg.with_precision(strategy, config.precision)
    if config.compile:
        strategy = sg.compiled(strategy)  # before accumulate, which holds the no_sync it wraps
    if config.grad_clip > 0:
        strategy = sg.with_clipping(strategy, max_norm=config.grad_clip)
    if config.gradient_accumulation_steps > 1:
        strategy = sg.accumulate(strategy, config.gradient_accumulation_steps)
    return strategy


def parse_args(argv: list[str] | None = None) -> Config:
    """Return the `Config` of the command line's flags (the rest keep their defaults)."""
    d = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default=d.strategy)
    parser.add_argument("--iters", type=int, default=d.max_iters, help="optimizer steps")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default=d.precision)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--checkpoint-dir", default=None, help="save <dir>/ckpt at evaluations")
    parser.add_argument("--resume", action="store_true", help="continue from <dir>/ckpt")
    parser.add_argument("--eval-interval", type=int, default=d.eval_interval)
    parser.add_argument("--grad-accum", type=int, default=d.gradient_accumulation_steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank")
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0: no clipping")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--devices", type=int, default=None, help="ranks on this host")
    parser.add_argument("--device", default=d.device, help="auto (default), cpu, cuda:0, ...")
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if not args.grad_clip >= 0:
        parser.error(f"--grad-clip must be 0 (off) or positive (got {args.grad_clip})")
    for flag in ("iters", "eval_interval", "grad_accum", "batch_size", "devices"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1 (got {value})")
    return dataclasses.replace(
        d,
        strategy=args.strategy,
        max_iters=args.iters,
        lr_decay_iters=args.iters,
        precision=args.precision,
        compile=args.compile,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        eval_interval=args.eval_interval,
        gradient_accumulation_steps=args.grad_accum,
        batch_size=args.batch_size,
        grad_clip=args.grad_clip,
        seed=args.seed,
        devices=args.devices,
        device=args.device,
    )


if __name__ == "__main__":  # spawned ranks import this file: run only in the launching process
    config = parse_args()
    env = sg.detect_env(os.environ)
    in_place = env.source != "single"  # torchrun or SLURM started the ranks
    strategy = build_strategy(config, in_place=in_place)
    if env.rank == 0:
        print(f"{strategy.name}: {config}", flush=True)
    devices = config.devices or ("auto" if in_place else 2)
    results = sg.launch(train, strategy, devices=devices, args=(config,))
    if env.rank == 0:
        if results[0]["losses"]:  # a resumed run may have had nothing left to train
            last = ", ".join(f"rank {r} {res['losses'][-1]:.4f}" for r, res in enumerate(results))
            print(f"last loss: {last}")
        print(f"final parameters digest: {results[0]['digest']}")
