"""A lean packed pass for Llama-family targets on a CPU: the decoder written out, projections fused.

Issue 54 profiled a packed pass (``engine.ragged``) of SmolLM2-135M at 8 rows once its
linear layers ran on prepacked oneDNN weights (``specops.core.cpu_linear``): the products took about
60 % of the pass, and the rest was Hugging Face's per-layer module calls, the RMSNorm written
as five elementwise ops, the rotary embedding, the cache object and three separate q/k/v and
two gate/up products per layer. vLLM's CPU backend runs the same model as fused QKV and
gate-up projections over oneDNN handles. :class:`LeanDecoder` does the same over the model's
own weights:

- per layer **one** q/k/v product and **one** gate/up product, on weights concatenated and
  prepacked once (oneDNN's blocked layout), then ``o_proj`` and ``down_proj`` on the packed
  weights ``specops.core.cpu_linear`` already keeps for them: 4 products a layer instead of 7;
- RMSNorm as ``F.rms_norm`` (one kernel); the rotary embedding gathered from a table the
  model's own ``rotary_emb`` computed (every rope scaling ``transformers`` knows), q's and k's
  heads rotated together; SiLU-and-multiply in place on the halves of the gate/up output;
- new keys and values copied into the requests' slots of the KV pool as whole rows of the
  pool flattened (one ``index_copy_`` each per layer), attention per request over its own
  slot (``ragged.ragged_attention``, the same function the Hugging Face path calls).

It computes what the Hugging Face forward computes, in another summation order (the fused
products): values agree at float32 precision (``tests/serving/engine/test_lean.py``), and
every request of a replica goes through it alike, so greedy speculative decoding still equals
target-only decoding token for token. It serves float32 Llama models on a CPU with oneDNN
(the default target and a float32 draft); anything else (another architecture, bfloat16, a
GPU, ``SPECOPS_LEAN_PASS=0``, ``SPECOPS_CPU_LINEAR=stock`` or ``wx``) keeps the Hugging Face
packed pass. Only the q/k/v and gate/up weights are copied (fused), so only they are checked for
an in-place change before a pass; the rest is read from the model as it is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specops.core import cpu_linear
from specops.serving.engine import ragged

log = logging.getLogger(__name__)

ENV = "SPECOPS_LEAN_PASS"
"""``0`` turns the lean pass off (every packed pass through Hugging Face's modules)."""
ARCHITECTURES = frozenset({"llama"})


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor
    """Packed ``[q; k; v]`` weight."""
    qkv_bias: torch.Tensor | None
    o: torch.nn.Linear
    gate_up: torch.Tensor
    """Packed ``[gate; up]`` weight."""
    gate_up_bias: torch.Tensor | None
    down: torch.nn.Linear


def supported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot take the lean pass, or None when it can."""
    cfg = model.config
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return f"architecture {getattr(cfg, 'model_type', None)!r}"
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return f"{p.dtype} on {p.device.type}"
    if not cpu_linear.onednn_available():
        return "no oneDNN in this torch"
    if os.environ.get(cpu_linear.ROUTE_ENV, "auto") in ("stock", "wx"):  # the lean pass is prepacked weights
        return f"{cpu_linear.ROUTE_ENV}={os.environ[cpu_linear.ROUTE_ENV]}"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "activation or tensor-parallel split"
    return None


def _cat_bias(*linears) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def _linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    packed = module.packed() if isinstance(module, cpu_linear.SmallBatchLinear) else None
    if packed is None:
        return F.linear(x, module.weight, module.bias)
    return cpu_linear.packed_linear(x, packed, module.bias)


class LeanDecoder:
    """The fused packed pass over a Llama model's weights (module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        why = supported(model)
        assert why is None, why
        self.model = model
        base = model.model
        cfg = model.config
        self.eps = float(cfg.rms_norm_eps)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.hidden = int(cfg.hidden_size)
        self.scaling = self.head_dim**-0.5
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm.weight
        self.layers: list[_Layer] = []
        self._sources: list[torch.Tensor] = []
        """The weights and biases the fused copies were made from (what :meth:`stale` checks)."""
        with torch.no_grad():
            for layer in base.layers[: cfg.num_hidden_layers]:
                a, m = layer.self_attn, layer.mlp
                fused = (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj)
                self._sources += [t for lin in fused for t in (lin.weight, lin.bias) if t is not None]
                self.layers.append(
                    _Layer(
                        ln1=layer.input_layernorm.weight,
                        ln2=layer.post_attention_layernorm.weight,
                        qkv=cpu_linear.pack_weight(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                        qkv_bias=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                        o=a.o_proj,
                        gate_up=cpu_linear.pack_weight(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                        gate_up_bias=_cat_bias(m.gate_proj, m.up_proj),
                        down=m.down_proj,
                    )
                )
        self.intermediate = int(base.layers[0].mlp.gate_proj.out_features)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._key = self._weights_key()

    def _weights_key(self) -> tuple:
        return tuple(cpu_linear._weight_key(t) for t in self._sources)

    def stale(self) -> bool:
        """The weights the fused copies were made from changed in place since (rebuild before use)."""
        return self._weights_key() != self._key

    def _rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` at ``positions``, gathered from a table the model's own
        ``rotary_emb`` computed (the same values as its per-pass call), grown by doubling."""
        top = int(positions.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < top:
            size = max(top, 2 * (self._rope_table[0].shape[0] if self._rope_table is not None else 256))
            cos, sin = self.rotary(like[None, :1], torch.arange(size, device=like.device)[None])
            self._rope_table = (cos[0], sin[0])
        cos, sin = self._rope_table
        return cos[positions][:, None, :], sin[positions][:, None, :]

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor, rows: ragged.Rows, pool) -> torch.Tensor:
        """The final-norm hidden states ``[T, hidden]`` of a packed pass, its new keys and values
        stored into the requests' slots of ``pool``. ``ids`` ``[T]``."""
        t = ids.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        k_end = (h + kvh) * d
        x = self.embed(ids)  # [T, hidden]
        cos, sin = self._rope(rows.pos_index, x)  # [T, 1, d]
        half = d // 2
        # every new key/value row's place in a layer's pool flattened to [slots * kv_heads * capacity, d]:
        # one indexed copy of whole rows per layer (an index_put over (slot, :, position) is several times slower)
        heads = torch.arange(kvh, device=ids.device)
        store = (rows.slot_index[:, None] * kvh + heads[None, :]) * pool.capacity + rows.pos_index[:, None]
        store = store.reshape(-1)
        for i, layer in enumerate(self.layers):
            y = F.rms_norm(x, (self.hidden,), layer.ln1, self.eps)
            qkv = cpu_linear.packed_linear(y, layer.qkv, layer.qkv_bias)  # [T, (h + 2 kvh) d]
            qk = qkv[:, :k_end].view(t, h + kvh, d)  # q's and k's heads rotated together
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, k_end:].reshape(t * kvh, d)
            k_buf, v_buf = pool.keys[i], pool.values[i]
            k_buf.view(-1, d).index_copy_(0, store, k.reshape(t * kvh, d))
            v_buf.view(-1, d).index_copy_(0, store, v)
            attn, _ = ragged.ragged_attention(
                None, q.transpose(0, 1)[None], k_buf, v_buf, None, scaling=self.scaling, specops_rows=rows
            )  # [1, T, h, d]
            x = x + _linear(attn.view(t, h * d), layer.o)
            y = F.rms_norm(x, (self.hidden,), layer.ln2, self.eps)
            gu = cpu_linear.packed_linear(y, layer.gate_up, layer.gate_up_bias)  # [T, 2 I]
            act = F.silu(gu[:, : self.intermediate], inplace=True).mul_(gu[:, self.intermediate :])
            x = x + _linear(act, layer.down)
        return F.rms_norm(x, (self.hidden,), self.norm, self.eps)


def install(model: PreTrainedModel) -> LeanDecoder | None:
    """A :class:`LeanDecoder` over ``model``, or None (logged) where it does not apply."""
    why = supported(model)
    if why is not None:
        log.info("lean packed pass off for %s: %s", type(model).__name__, why)
        return None
    return LeanDecoder(model)
