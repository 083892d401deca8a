"""The drafter's optimizer and lr schedule from its config: fused AdamW, or Muon with AdamW for the rest.

`optimizer = "muon"` (speculators' split, recipes.md §4): Muon (consumer/muon.py: torch.optim.Muon's arithmetic,
its Newton–Schulz split over the replicas) for every trainable 2-D matrix
with min(shape) > 1 whose name holds none of `embed`, `lm_head`, `codebook`, `markov` (the attention and MLP
projections, the `fc` fusion); AdamW for everything else (norm scales, biases, 1-D, degenerate and 3-D
tensors, codebooks, DSpark's Markov tables: a [V, r] embedding and a [V, r] vocabulary head). The two step together as one optimizer (`MuonWithAdamW`) and share one schedule:
each optimizer's own LambdaLR with the same factor (`Schedules`).

A non-finite step is skipped as fused AdamW skips it (`found_inf`, no device sync): Muon selects each
matrix's old weight and momentum with torch.where, one matrix at a time (consumer/muon.py).

With replicas, each matrix's Newton–Schulz runs on one replica and the result is sent to the others
(`split_over` the group for replicated weights; FSDP's DTensor row shards use their mesh). A checkpoint
holds each torch optimizer's state as full tensors (consumer/fsdp_lockstep.py, through `map_torch_states`):
the unsharded format, the same as torch.optim.Muon's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from common.config import DrafterConfig
from consumer.muon import SplitMuon

NOT_MUON = ("embed", "lm_head", "codebook", "markov")  # names routed to AdamW whatever their shape


def is_muon_param(name: str, p: Tensor) -> bool:
    """Muon's share: a trainable 2-D matrix (both sides > 1) that is not an embedding, head or codebook."""
    return p.requires_grad and p.ndim == 2 and min(p.shape) > 1 and not any(s in name for s in NOT_MUON)


def _adamw(cfg: DrafterConfig, params: list[Tensor]) -> torch.optim.AdamW:
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norm scales, biases
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, fused=True)


class MuonWithAdamW:
    """Muon and AdamW stepped, zeroed and saved as one optimizer (the interface the trainer uses)."""

    def __init__(self, muon: SplitMuon, adamw: torch.optim.AdamW):
        self.muon = muon
        self.adamw = adamw
        self.found_inf: Tensor | None = None  # set before step(): 1.0 skips the whole update

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @torch.no_grad()
    def step(self) -> None:
        self.adamw.found_inf = self.found_inf
        self.adamw.step()
        self.muon.found_inf = self.found_inf
        self.muon.step()

    def split_over(self, process_group) -> None:
        """Newton–Schulz of replicated weights split over the replicas' group (consumer/muon.py)."""
        self.muon.split_over(process_group)

    def torch_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Each torch optimizer under its key in state_dict()."""
        return {"muon": self.muon, "adamw": self.adamw}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def map_torch_states(optimizer, state: dict, fn: Callable[[torch.optim.Optimizer, dict], dict]) -> dict:
    """`state` (an optimizer.state_dict() of this module's optimizers) with `fn(torch_optimizer, its state dict)`
    in place of each torch optimizer's part: AdamW's whole dict, or MuonWithAdamW's "muon" and "adamw"."""
    if isinstance(optimizer, MuonWithAdamW):
        return {key: fn(o, state[key]) for key, o in optimizer.torch_optimizers().items()}
    return fn(optimizer, state)


def check_optimizer_state(cfg: DrafterConfig, state: dict, source: str) -> None:
    """A saved optimizer state matches the drafter's `optimizer` key, or the error says which it was."""
    saved = "muon" if set(state) == {"muon", "adamw"} else "adamw"
    if saved != cfg.optimizer:
        raise ValueError(
            f"drafter {cfg.name}: {source} was trained with optimizer = {saved!r}, this job has"
            f" optimizer = {cfg.optimizer!r}: resume with the optimizer it was saved with (or start"
            " a fresh run directory)"
        )


class Schedules:
    """One LambdaLR per optimizer, the same factor for all, saved and restored together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], factor: Callable[[int], float]):
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        """AdamW's lrs first (the trainer logs the first: the `lr` key), then Muon's."""
        return [lr for s in reversed(self.schedulers) for lr in s.get_last_lr()]

    def state_dict(self) -> dict:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for s, st in zip(self.schedulers, state["schedulers"], strict=True):
            s.load_state_dict(st)


def build_optimizer(cfg: DrafterConfig, named_params: Iterable[tuple[str, Tensor]], factor: Callable[[int], float]):
    """(optimizer, scheduler) for the drafter's trainable parameters; `factor(step)` scales every lr.
    AdamW alone keeps the plain torch objects (and their checkpoint format)."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if cfg.optimizer == "adamw":
        adamw = _adamw(cfg, [p for _, p in named])
        return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, factor)
    muon_params = [p for n, p in named if is_muon_param(n, p)]
    rest = [p for n, p in named if not is_muon_param(n, p)]
    muon = SplitMuon(
        muon_params,
        lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
    )
    adamw = _adamw(cfg, rest)
    return MuonWithAdamW(muon, adamw), Schedules([muon, adamw], factor)
