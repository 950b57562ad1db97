"""The training loop: label-smoothed loss, Adam with the paper's warm-up schedule, token-count
batches, periodic validation (loss, greedy BLEU/chrF), `last`/`best`/periodic checkpoints with
exact resume, TensorBoard logs, bf16 autocast on CUDA, and DDP under torchrun.

    nmtserve train --data data/ --out runs/small --max-minutes 20
    torchrun --nproc-per-node 2 -m nmtserve.cli train --data data/ --out runs/ddp
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from nmtserve.console import on_terminal
from nmtserve.errors import ConfigError
from nmtserve.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from nmtserve.training import checkpoint
from nmtserve.training.data import Example, ParallelCorpus, ReadStats, collate, read_corpus, split_file, token_batches
from nmtserve.training.evaluate import evaluate_pairs
from nmtserve.training.model import PRESETS, EncoderDecoder, ModelConfig


@dataclass
class TrainConfig:
    out: str = "runs/default"
    data: str | None = None  # a directory written by `nmtserve data`
    train: list[str] | None = None  # a TSV file or a Moses pair (source file, target file)
    valid: list[str] | None = None  # likewise; default: the data dir's valid split, or a slice of train
    preset: str = "small"
    pre_norm: bool = False
    # tuned on the built-in corpus within 20 minutes on 2 cores: each pair is seen about 1.5 times,
    # so dropout only slows learning; raise it (0.1-0.3) for small real corpora trained for many epochs
    dropout: float = 0.0
    vocab_size: int = 4000
    max_len: int = 128  # pairs longer than this many tokens on either side are skipped and counted
    max_tokens: int = 2000  # padded target+source tokens per batch (per process under DDP)
    lr_factor: float = 0.6  # peak learning rate 0.6 · 256^-0.5 · 300^-0.5 ≈ 2.2e-3 for `small`
    warmup: int = 300
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    max_steps: int = 0  # 0: no step limit
    max_minutes: float = 0.0  # 0: no time limit
    epochs: int = 0  # 0: no epoch limit
    valid_every: int = 250
    valid_bleu_sentences: int = 500
    log_every: int = 20
    keep_checkpoints: int = 5
    average_last: int = 4  # at the end, average the last N periodic checkpoints into average.pt
    seed: int = 1
    resume: bool = False
    device: str = "auto"


@dataclass
class TrainState:
    """What, besides weights and optimizer, resuming needs to continue exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    best_bleu: float = -1.0
    best_loss: float = math.inf
    elapsed_s: float = 0.0
    history: list[dict] = field(default_factory=list)  # validation results


# ---------------------------------------------------------------- distribution
@dataclass
class Distributed:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device) -> Distributed:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cpu":  # processes share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        return cls(dist.get_rank(), dist.get_world_size())

    def any(self, flag: bool) -> bool:
        """True on every process if it is True on any (to stop together)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    if name.startswith("cuda") and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device(name)


# ---------------------------------------------------------------- data
def load_corpora(cfg: TrainConfig) -> tuple[ParallelCorpus, ParallelCorpus]:
    if cfg.train:
        train = read_corpus(cfg.train)
    elif cfg.data:
        train = read_corpus([split_file(cfg.data, "train")])
    else:
        raise ConfigError("no training data: give --data DIR (from `nmtserve data`) or --train FILE [TARGET_FILE]")
    if cfg.valid:
        valid = read_corpus(cfg.valid)
    elif cfg.data and (Path(cfg.data) / "valid.tsv").is_file():
        valid = read_corpus([split_file(cfg.data, "valid")])
    else:  # hold out the tail of the training data
        n = min(500, max(1, len(train.pairs) // 20))
        valid = ParallelCorpus(train.pairs[-n:], ReadStats(read=n, kept=n), train.source + " (held out)")
        train = ParallelCorpus(train.pairs[:-n], train.stats, train.source)
    if not train.pairs:
        raise ConfigError(f"{train.source}: no usable training pairs ({train.stats.skipped_empty} empty, "
                          f"{train.stats.skipped_too_long} too long)")
    return train, valid


def encode_pairs(tokenizer: Tokenizer, pairs: list[tuple[str, str]], max_len: int) -> tuple[list[Example], int]:
    """Token ids of each pair; pairs over max_len tokens on either side are skipped and counted."""
    src = tokenizer.encode_batch([s for s, _ in pairs])
    tgt = tokenizer.encode_batch([t for _, t in pairs])
    examples = [Example(s, t) for s, t in zip(src, tgt) if len(s) <= max_len and len(t) + 1 <= max_len]
    return examples, len(pairs) - len(examples)


def inverse_sqrt_schedule(d_model: int, warmup: int, factor: float):
    """lrate = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) (the paper's, with a factor)."""
    def lr(step0: int) -> float:
        step = step0 + 1
        return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    return lr


# ---------------------------------------------------------------- the loop
class TrainLog:
    """Every `every` steps: loss, learning rate and tokens/s to the progress bar, a JSONL file and TensorBoard."""

    def __init__(self, path: Path, writer, distributed: Distributed, every: int, append: bool):
        self.writer, self.world, self.every = writer, distributed.world, every
        self.file = open(path, "a" if append else "w", encoding="utf-8") if distributed.main else None
        self.since, self.tokens = time.monotonic(), 0

    def step(self, step: int, loss: float, lr: float, tokens: int, bar) -> None:
        self.tokens += tokens
        if self.file is None or step % self.every:
            return
        now = time.monotonic()
        tok_s = self.tokens * self.world / max(1e-9, now - self.since)  # every process takes as many tokens, roughly
        self.since, self.tokens = now, 0
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}", refresh=False)
        self.file.write(json.dumps({"step": step, "loss": loss, "lr": lr, "tok_s": round(tok_s)}) + "\n")
        self.file.flush()
        for key, value in (("train/loss", loss), ("train/lr", lr), ("train/tokens_per_s", tok_s)):
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()


class Trainer:
    """Owns model, optimizer, schedule, data order and checkpoints of one run."""

    def __init__(self, cfg: TrainConfig):
        if cfg.preset not in PRESETS:
            raise ConfigError(f"--preset {cfg.preset!r}: choose one of {', '.join(PRESETS)}")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dist = Distributed.from_env(self.device)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state = TrainState()
        resume_payload = self._resume_payload()

        train, valid = load_corpora(cfg)
        self.data_summary = {"train_source": train.source, "valid_source": valid.source,
                             "train_read": asdict(train.stats), "valid_read": asdict(valid.stats)}
        self.tokenizer = (Tokenizer(resume_payload["tokenizer"]) if resume_payload else
                          Tokenizer.train((s for pair in train.pairs for s in pair), cfg.vocab_size, cfg.seed))
        self.examples, skipped = encode_pairs(self.tokenizer, train.pairs, cfg.max_len)
        self.data_summary["train_skipped_over_max_len"] = skipped
        self.valid_pairs = valid.pairs
        self.valid_examples, _ = encode_pairs(self.tokenizer, valid.pairs, cfg.max_len)
        if not self.examples:
            raise ConfigError(f"every training pair is longer than --max-pair-tokens {cfg.max_len} tokens")

        torch.manual_seed(cfg.seed)
        self.model_config = ModelConfig.preset(cfg.preset, vocab_size=self.tokenizer.vocab_size, dropout=cfg.dropout,
                                               pre_norm=cfg.pre_norm, max_len=max(256, cfg.max_len + 1))
        self.model = EncoderDecoder(self.model_config).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, inverse_sqrt_schedule(self.model_config.d_model, cfg.warmup, cfg.lr_factor))
        if resume_payload:
            self._restore(resume_payload)
        self.ddp_model = self.model
        if self.dist.world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)  # the only buffer is the constant position table
        self.writer = None
        if self.dist.main:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.out / "tensorboard"))

    # -- resume
    def _resume_payload(self) -> dict | None:
        last = self.out / "last.pt"
        if not self.cfg.resume:
            return None
        if not last.is_file():
            raise ConfigError(f"--resume: {last} does not exist; start without --resume")
        return checkpoint.read(last)

    def _restore(self, payload: dict) -> None:
        if payload["model_config"] != self.model_config.to_dict():
            raise ConfigError(f"--resume: {self.out / 'last.pt'} was trained with another model config")
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.state = TrainState(**payload["state"])
        rng = payload["rng"]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if torch.cuda.is_available() and rng.get("cuda") is not None:
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _payload(self, with_training_state: bool) -> dict:
        payload = {"model": self.model.state_dict(), "model_config": self.model_config.to_dict(),
                   "tokenizer": self.tokenizer.model_proto, "special_ids": self.tokenizer.special_ids(),
                   "train_config": asdict(self.cfg), "data": self.data_summary, "step": self.state.step,
                   "metrics": self.state.history[-1] if self.state.history else None}
        if with_training_state:
            payload.update(optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
                           state=asdict(self.state),
                           rng={"python": random.getstate(), "torch": torch.get_rng_state(),
                                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None})
        return payload

    # -- one step
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, model, batch) -> torch.Tensor:
        with self._autocast():
            log_probs = model(batch.src, batch.src_mask, batch.tgt_in, batch.tgt_mask)
        return F.cross_entropy(log_probs.float().transpose(1, 2), batch.tgt_out, ignore_index=PAD_ID,
                               label_smoothing=self.cfg.label_smoothing, reduction="sum")

    def train_step(self, batch) -> float:
        self.model.train()
        loss = self._loss(self.ddp_model, batch) / batch.n_tokens
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += batch.n_tokens
        return loss.item()

    # -- validation
    @torch.inference_mode()
    def validation_loss(self) -> float:
        self.model.eval()
        lengths = [max(len(e.src), len(e.tgt) + 1) for e in self.valid_examples]
        total, tokens = 0.0, 0
        for idx in token_batches(lengths, self.cfg.max_tokens, seed=0, epoch=0):
            batch = collate([self.valid_examples[i] for i in idx], PAD_ID, BOS_ID, EOS_ID).to(self.device)
            total += self._loss(self.model, batch).item()  # main process only: not the DDP wrapper
            tokens += batch.n_tokens
        return total / max(1, tokens)

    def validate(self) -> dict:
        loss = self.validation_loss()
        pairs = self.valid_pairs[: self.cfg.valid_bleu_sentences]
        scores, _ = evaluate_pairs(self.model, self.tokenizer, pairs, device=self.device)
        result = {"step": self.state.step, "epoch": self.state.epoch, "valid_loss": round(loss, 4),
                  **{f"valid_{k}": v for k, v in scores.to_dict().items()},
                  "elapsed_s": round(self.state.elapsed_s, 1), "tokens_seen": self.state.tokens_seen}
        self.state.history.append(result)
        for key in ("valid_loss", "valid_bleu", "valid_chrf"):
            self.writer.add_scalar(key.replace("_", "/", 1), result[key], self.state.step)
        return result

    def checkpoint(self) -> dict:
        """Validate, then write last.pt, step_N.pt and (if better) best.pt; main process only."""
        result = self.validate()
        is_best = (result["valid_bleu"], -result["valid_loss"]) > (self.state.best_bleu, -self.state.best_loss)
        if is_best:
            self.state.best_bleu, self.state.best_loss = result["valid_bleu"], result["valid_loss"]
        payload = self._payload(with_training_state=True)
        checkpoint.save(self.out / "last.pt", payload)
        checkpoint.save(self.out / f"step_{self.state.step:08d}.pt", self._payload(with_training_state=False))
        if is_best:
            checkpoint.save(self.out / "best.pt", self._payload(with_training_state=False))
        for old in sorted(self.out.glob("step_*.pt"))[: -self.cfg.keep_checkpoints or None]:
            old.unlink()
        return {**result, "best": is_best}

    # -- the loop
    def _elapsed(self) -> float:
        return self._elapsed_base + time.monotonic() - self._clock_start

    def _should_stop(self) -> bool:
        cfg, s = self.cfg, self.state
        over_time = cfg.max_minutes > 0 and self._elapsed() >= cfg.max_minutes * 60
        over_steps = cfg.max_steps > 0 and s.step >= cfg.max_steps
        return self.dist.any(over_steps or (cfg.epochs > 0 and s.epoch >= cfg.epochs) or over_time)

    def _epoch_batches(self) -> list[list[int]]:
        lengths = [max(len(e.src), len(e.tgt) + 1) for e in self.examples]
        batches = token_batches(lengths, self.cfg.max_tokens, self.cfg.seed, self.state.epoch)
        per_rank = len(batches) // self.dist.world  # every process takes as many steps
        return batches[self.dist.rank:: self.dist.world][:per_rank]

    def fit(self) -> dict:
        cfg = self.cfg
        if cfg.max_steps <= 0 and cfg.max_minutes <= 0 and cfg.epochs <= 0:
            raise ConfigError("no stopping rule: give --max-steps, --max-minutes or --epochs")
        self._clock_start, self._elapsed_base = time.monotonic(), self.state.elapsed_s
        self._log = TrainLog(self.out / "train_log.jsonl", self.writer, self.dist, cfg.log_every, append=cfg.resume)
        # a bar on a terminal; in pipes and CI only the validation lines (and the summary) are printed
        bar = tqdm(total=cfg.max_steps or None, initial=self.state.step, disable=not (self.dist.main and on_terminal()),
                   mininterval=1.0, dynamic_ncols=True, unit="step")
        last_result = None
        try:
            while not self._should_stop():
                stop = False
                for idx in self._epoch_batches()[self.state.batch_in_epoch:]:
                    batch = collate([self.examples[i] for i in idx], PAD_ID, BOS_ID, EOS_ID).to(self.device)
                    lr = self.scheduler.get_last_lr()[0]
                    loss = self.train_step(batch)
                    self.state.batch_in_epoch += 1
                    bar.update(1)
                    self._log.step(self.state.step, loss, lr, batch.n_tokens, bar)
                    stop = self._should_stop()
                    if stop or self.state.step % cfg.valid_every == 0:
                        last_result = self._periodic(bar)
                    if stop:
                        break
                if not stop:
                    self.state.epoch += 1
                    self.state.batch_in_epoch = 0
        finally:
            bar.close()
            self._log.close()
        if last_result is None or last_result["step"] != self.state.step:
            last_result = self._periodic(None)
        return self._finish(last_result)

    def _periodic(self, bar) -> dict:
        """Validate and checkpoint on the main process; the others wait."""
        self.state.elapsed_s = self._elapsed()
        result = {"step": self.state.step}
        if self.dist.main:
            result = self.checkpoint()
            line = (f"step {result['step']}: valid loss {result['valid_loss']:.3f}  BLEU {result['valid_bleu']:.2f}  "
                    f"chrF {result['valid_chrf']:.2f}{'  (best)' if result['best'] else ''}")
            (bar.write if bar is not None else print)(line, file=sys.stderr)
        self.dist.barrier()
        return result

    def _finish(self, last_result: dict) -> dict:
        summary = {"out": str(self.out), "steps": self.state.step, "epochs_completed": self.state.epoch,
                   "tokens_seen": self.state.tokens_seen, "parameters": self.model.num_parameters(),
                   "vocab_size": self.tokenizer.vocab_size, "world_size": self.dist.world,
                   "device": str(self.device), "best_valid_bleu": self.state.best_bleu, "last": last_result,
                   "data": self.data_summary}
        if self.dist.main and self.cfg.average_last > 0:
            steps = sorted(self.out.glob("step_*.pt"))[-self.cfg.average_last:]
            summary["average"] = str(checkpoint.average(steps, self.out / "average.pt"))
        if self.writer:
            self.writer.close()
        if self.dist.world > 1:  # all ranks together: once in make test, rank 1 aborted tearing gloo down while
            self.dist.barrier()  # rank 0 still averaged ("terminate called without an active exception"; 0 of 10 since)
            dist.destroy_process_group()
        return summary


def train(cfg: TrainConfig) -> dict:
    return Trainer(cfg).fit()
