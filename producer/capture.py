"""The packed forward of a loaded target (producer/target.py loads it): capture the hidden states the drafter is
conditioned on, for a batch of sequences laid end to end.

The forward is the model's own, so rotary embeddings, attention kernels and layer internals stay exactly the
library's; forward hooks on the captured layers copy each output into its column block of the feature buffer.

Packed batches: the tokens of B sequences lie end to end ([T] with cu_seqlens [B+1]) and run as ONE forward,
exact for every layer kind:
- attention layers (full, sliding-window, attention sinks), packing "position_ids": position ids restart at 0
  for every sequence and no attention mask is passed, so the model's own mask builders
  (transformers.masking_utils) detect the packing from the position ids and intersect THEIR mask (causal,
  sliding window, chunked) with "same sequence". A hand-made block-diagonal mask would override a sliding
  window (it did: 0.2 off on Mistral). Packing "layer_masks", for models that do not hand their position ids
  to the mask builders (gpt-oss): the same builders are called here, one mask per layer type, passed as the
  mapping such models accept. With the CPU default attention (producer/packed_attention.py) the sequence
  bounds also go to the attention as `cu_seq_lens_q/k`, and each sequence attends within its own block of
  that mask: Σ L² work, no [T, T] mask.
- linear-attention layers (Gated DeltaNet in qwen3_next / qwen3_5): their recurrent and convolution states
  must restart per sequence. transformers' packed path (`cu_seq_lens_q` → `cu_seqlens`) needs the
  flash-linear-attention kernels (the torch fallback ignores `cu_seqlens`); so each linear-attention module
  is wrapped to run the sequences as right-padded batches of similar lengths (causal layers: padding after a
  sequence never reaches it), the rest of the stack stays packed.
- token mixers with a state and no packed path (a depthwise token convolution: lfm2; a state-space recurrence:
  the Mamba mixers of falcon_h1, jamba, mamba) are found by their structure, whatever the layer kinds say.
- at load, a leak probe packs two sequences and compares each with itself run alone, in the target's dtype:
  the first has nothing before it to leak from, so its difference is the packing's own rounding (matmul shapes,
  MoE expert batches); the second's must stay within PROBE_NOISE_FACTOR x that noise, at least a floor below
  one rounding of the dtype (bf16: 2^-10), so a 16-bit dtype's coarse rounding never hides a leak. The first
  packing mode that passes is used. A layer kind with no packed path, such a mixer, or no mode passing means
  one forward per sequence; the reason is logged once at load and every such batch is counted
  (`target_per_sequence_batches` in the producer's stats). Never refused, never corrupted.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from common.profile import ProfileStats
from producer import packed_attention

# the library's mask builder for each attention layer kind ("layer_masks" packing)
MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
}
ATTENTION_KINDS = set(MASK_BUILDERS)
LINEAR_KIND = "linear_attention"
PAD_SLACK = 1.3  # a padded group holds at most 30% more rows than tokens
# The leak probe's tolerance: PROBE_NOISE_FACTOR × the packing's measured rounding noise, at least the floor
# (a quarter of the dtype's unit roundoff, fp32: 1e-5 for its MoE batching; on the CPU a packing that keeps its
# sequences apart rounds exactly as alone in 16 bits: noise 0, where the state-space hybrids leak 7e-3..8e-3)
PROBE_NOISE_FACTOR = 4.0
PROBE_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2.0**-10, torch.float16: 2.0**-13}

log = logging.getLogger("producer.target")


@dataclass(frozen=True)
class LeakProbe:
    """The load-time leak probe's measurements (relative change per token, L2, the largest)."""

    noise: float  # the first packed sequence vs alone: nothing precedes it, so rounding only
    leak: float  # the second packed sequence vs alone: rounding plus whatever crossed over
    floor: float  # the tolerance when the noise is smaller

    @property
    def tolerance(self) -> float:
        return max(self.floor, PROBE_NOISE_FACTOR * self.noise)

    @property
    def passed(self) -> bool:
        return self.leak <= self.tolerance

    def __str__(self) -> str:
        return f"change {self.leak:.2g}, rounding noise {self.noise:.2g}, tolerance {self.tolerance:.2g}"


def _stateful_mixer(model: nn.Module, prefix: str = "") -> str | None:
    """The guard for what the layer kinds do not say (and a probe could miss): a token mixer that keeps a state
    across tokens — a depthwise (token) convolution or a state-space decay `A_log` — outside the padded-batch
    wrappers has no packed path. The reason, naming the module, or None."""
    wrapped = [name for name, m in model.named_modules() if isinstance(m, PaddedBatchMixer)]
    for name, module in model.named_modules():
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        if isinstance(module, nn.Conv1d) and module.groups == module.in_channels > 1:
            what = "a depthwise convolution over the tokens"
        elif isinstance(getattr(module, "A_log", None), nn.Parameter):
            what = "a state-space recurrence (A_log)"
        else:
            continue
        return (
            f"{prefix}{name} ({type(module).__name__}) is {what}, which carries a state from one sequence into the next"
        )
    return None


def _relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences of similar length as one right-padded batch [B, L]."""

    batch: int
    max_len: int
    gather: torch.Tensor  # [B·L] index into the packed tokens, T (a zero row) for padding
    valid: torch.Tensor  # [n] rows of the flattened padded batch that hold tokens
    dest: torch.Tensor  # [n] where those tokens lie in the packed batch


@dataclass(frozen=True)
class Segments:
    """Where the packed sequences lie, for running a per-sequence module as a few right-padded batches.

    Sequences sorted by length are cut into groups whose padding stays under PAD_SLACK of their tokens (so
    one long sequence does not make nine short ones pay its length), each group one call of the module.
    """

    groups: tuple[PaddedGroup, ...]

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, device: torch.device) -> Segments:
        lengths = lengths.to("cpu", torch.int64)
        total = int(lengths.sum())
        starts = torch.cumsum(lengths, 0) - lengths
        order = torch.argsort(lengths, descending=True, stable=True).tolist()
        groups, current = [], []
        for i in order:
            n = int(lengths[i])
            if current and (len(current) + 1) * int(lengths[current[0]]) > PAD_SLACK * (
                int(lengths[current].sum()) + n
            ):
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        return cls(tuple(cls._group(lengths[g], starts[g], total, device) for g in groups))

    @staticmethod
    def _group(lengths: torch.Tensor, starts: torch.Tensor, total: int, device: torch.device) -> PaddedGroup:
        max_len = int(lengths.max())
        pos = torch.arange(max_len)
        valid = pos[None, :] < lengths[:, None]  # [B, L]
        src = starts[:, None] + pos[None, :]
        gather = torch.where(valid, src, torch.tensor(total)).flatten()

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return PaddedGroup(
            len(lengths), max_len, put(gather), put(valid.flatten().nonzero().flatten()), put(src[valid])
        )


class PaddedBatchMixer(nn.Module):
    """Runs a recurrent token mixer (e.g. Gated DeltaNet) on packed sequences as right-padded batches.

    The wrapped module is the model's own; only its input is regrouped, so no state crosses sequences.
    """

    def __init__(self, inner: nn.Module, capture: TargetCapture):
        super().__init__()
        self.inner = inner
        self._capture = [capture]  # a list: not registered as a submodule

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seg = self._capture[0].segments
        if seg is None:  # one sequence: nothing to keep apart
            return self.inner(hidden_states)
        flat = hidden_states[0]  # [T, H]
        padded_source = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
        out = None
        for g in seg.groups:
            y = self.inner(padded_source[g.gather].view(g.batch, g.max_len, -1))  # no cache, no mask: pads at the end
            y = y.reshape(g.batch * g.max_len, -1)[g.valid]
            if out is None:
                out = y.new_empty(flat.shape[0], y.shape[-1])
            out.index_copy_(0, g.dest, y)
        return out.unsqueeze(0)


class TargetCapture:
    """A frozen, truncated target that returns concat(outputs of decoder layers in `layer_ids`) per token."""

    def __init__(
        self,
        model: nn.Module,
        config: PretrainedConfig,
        layer_ids: list[int],
        num_target_layers: int,
    ):
        self.model = model  # the base decoder (no LM head), truncated after max(layer_ids)
        self.config = config
        self.layer_ids = list(layer_ids)
        self.num_target_layers = num_target_layers
        self.hidden_size = int(config.hidden_size)
        self.param = next(model.parameters())
        self.attn_implementation = config._attn_implementation
        self.prof: ProfileStats | None = None  # set by the producer: counts per-sequence batches
        self.per_sequence_batches = 0
        self.segments: Segments | None = None  # set during a packed forward
        self._out: torch.Tensor | None = None
        # HF's hidden_states[N] is the final-normed output, so the last layer is read from the model output
        self.last_block = self.layer_ids.index(num_target_layers - 1) if num_target_layers - 1 in layer_ids else None
        for k, i in enumerate(self.layer_ids):
            if k != self.last_block:
                model.layers[i].register_forward_hook(self._copy_hook(k))
        self.packing = "position_ids"  # how a packed batch keeps its sequences apart (module docstring)
        self.per_sequence_reason = self._wrap_linear_layers()
        if self.per_sequence_reason is None:
            self.per_sequence_reason = self._choose_packing()
        if self.per_sequence_reason:
            self.packing = "per_sequence"
            log.warning("packed batches run one forward per sequence: %s", self.per_sequence_reason)

    def _choose_packing(self) -> str | None:
        """The first packing mode that passes the leak probe; else the reason none does."""
        modes = ["position_ids"]
        kinds = set(getattr(self.config, "layer_types", None) or [])
        if kinds and kinds <= MASK_BUILDERS.keys():  # models that take one mask per layer kind
            modes.append("layer_masks")
        probes = {}
        for mode in modes:
            self.packing = mode
            probes[mode] = self.packing_leak()
            if probes[mode].passed:
                return None
        return (
            f"{type(self.model).__name__}: a packed sequence's features differ from the sequence run alone by more"
            f" than the packing's own rounding ({'; '.join(f'{m}: {p}' for m, p in probes.items())})"
        )

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def layers_run(self) -> int:
        return len(self.model.layers)

    @property
    def packed(self) -> bool:
        """True when a batch of several sequences runs as one forward."""
        return self.per_sequence_reason is None

    def _wrap_linear_layers(self) -> str | None:
        """Wrap every linear-attention mixer in PaddedBatchMixer; the reason packing is impossible, or None."""
        kinds = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.layers_run)
        unknown = sorted(set(kinds) - ATTENTION_KINDS - {LINEAR_KIND})
        if unknown:
            return f"layer types {unknown} have no packed path"
        for i, kind in enumerate(kinds):
            if kind != LINEAR_KIND:
                continue
            layer = self.model.layers[i]
            if not isinstance(getattr(layer, "linear_attn", None), nn.Module):  # e.g. a Mamba mixer (jamba, mamba)
                return _stateful_mixer(layer, f"layers.{i}.") or (
                    f"linear-attention layer {i} ({type(layer).__name__}) has no `linear_attn` module to wrap"
                )
            layer.linear_attn = PaddedBatchMixer(layer.linear_attn, self)
        return _stateful_mixer(self.model)

    @torch.inference_mode()
    def packing_leak(self) -> LeakProbe:
        """Leak probe: two sequences packed, each compared with itself run alone, in the target's dtype. The first
        one has nothing before it to leak from, so its difference is the packing's own rounding (other matmul
        shapes, other MoE expert batches): the noise. The second one's difference is that noise plus any leak."""
        gen = torch.Generator().manual_seed(0)
        vocab = int(self.config.vocab_size)
        first = torch.randint(0, vocab, (13,), generator=gen)
        second = torch.randint(0, vocab, (7,), generator=gen)
        packed = self._packed(torch.cat([first, second]), torch.tensor([0, 13, 20])).float()
        alone = [self._packed(s, torch.tensor([0, len(s)])).float() for s in (first, second)]
        return LeakProbe(
            noise=_relative_change(packed[:13], alone[0]),
            leak=_relative_change(packed[13:], alone[1]),
            floor=PROBE_FLOOR.get(self.dtype, PROBE_FLOOR[torch.bfloat16]),
        )

    def _copy_hook(self, k: int):
        h = self.hidden_size

        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, tuple) else output  # [1, T, H]
            self._out[:, k * h : (k + 1) * h].copy_(hidden[0])

        return hook

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [T] (any device), cu_seqlens [B+1] int on the host → features [T, n·H] in the target dtype.

        `out` (optional, [T, n·H], target dtype, on the target's device) receives the features in place, e.g.
        a view into a ring slot, so they are written once.
        """
        if self.packed or len(cu_seqlens) == 2:
            return self._packed(input_ids, cu_seqlens, out)
        return self.forward_per_sequence(input_ids, cu_seqlens, out)

    __call__ = forward

    @torch.inference_mode()
    def forward_per_sequence(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The fallback: one forward per sequence (also the baseline bench/producer.py measures against)."""
        _, out = self._check(input_ids, cu_seqlens, out)
        self.per_sequence_batches += 1
        if self.prof is not None:
            self.prof.count("target_per_sequence_batches")
        cu = cu_seqlens.tolist()
        for s, e in itertools.pairwise(cu):
            self._run(input_ids[s:e], torch.arange(e - s), out[s:e], None, None)
        return out

    def _packed(self, input_ids, cu_seqlens, out=None) -> torch.Tensor:
        lengths, out = self._check(input_ids, cu_seqlens, out)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
        positions = torch.arange(len(seq_idx)) - cu_seqlens[:-1].to("cpu", torch.int64)[seq_idx]
        packed = len(lengths) > 1
        segments = Segments.from_lengths(lengths, self.device) if packed else None
        self._run(input_ids, positions, out, segments, cu_seqlens.to("cpu", torch.int64) if packed else None)
        return out

    def _check(self, input_ids, cu_seqlens, out) -> tuple[torch.Tensor, torch.Tensor]:
        total = int(input_ids.shape[0])
        cu = cu_seqlens.to("cpu", torch.int64)
        lengths = torch.diff(cu)
        if len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths <= 0).any()):
            raise ValueError(f"cu_seqlens {cu.tolist()} does not split {total} tokens into non-empty runs")
        dev = self.device
        if out is None:
            out = torch.empty(total, self.feature_width, dtype=self.dtype, device=dev)
        elif out.shape != (total, self.feature_width) or out.dtype != self.dtype or out.device != dev:
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected"
                f" {(total, self.feature_width)} {self.dtype} on {dev}"
            )
        return lengths, out

    def _run(self, ids, positions, out, segments: Segments | None, cu_seqlens: torch.Tensor | None) -> None:
        """One model forward over `ids` [t] with `positions` [t] (sequences at `cu_seqlens`, on the host, or one
        sequence when None); the captured layers land in `out` [t, n·H]."""
        dev, t = self.device, int(ids.shape[0])
        ids = ids.to(dev, non_blocking=True).view(1, t)
        positions = positions.to(dev, non_blocking=True).view(1, t)
        embeds = self.model.get_input_embeddings()(ids)
        mask = None  # "position_ids": the model's mask builders read the packing from the position ids
        if self.packing == "layer_masks":  # models that do not hand position ids to their mask builders
            kw = dict(config=self.config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
            mask = {kind: MASK_BUILDERS[kind](**kw) for kind in set(self.config.layer_types)}
        varlen = {}  # the sequence bounds, for the attention that runs per sequence (producer/packed_attention.py)
        if self.attn_implementation in packed_attention.NAMES and cu_seqlens is not None:
            varlen = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
        self._out, self.segments = out, segments
        try:
            result = self.model(
                inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False, **varlen
            )
        finally:
            self._out, self.segments = None, None
        if self.last_block is not None:
            h = self.hidden_size
            out[:, self.last_block * h : (self.last_block + 1) * h].copy_(result.last_hidden_state[0])
