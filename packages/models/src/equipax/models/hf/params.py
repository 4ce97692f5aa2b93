"""Which Hugging Face tensors each `TransformerLM` array is made of, and how (no JAX).

A Hugging Face Llama / Mistral / Qwen3 checkpoint holds one tensor per layer and projection, in
PyTorch's `[out, in]` layout: `model.layers.{i}.self_attn.q_proj.weight` is `[heads * head_dim,
embed]`. equipax holds `[embed, heads, head_dim]` queries, a `[embed, 2, kv_heads, head_dim]`
key/value projection, and the layers stacked on leading axes (`[layer]` scanned, `[stage, repeat,
layer]` pipelined, one block each unrolled). A `TensorMap` says, for one equipax array, which
tensor fills each position of its stacked axes and how that tensor is reshaped and transposed:
`TensorMap.read` fills any index of the array (a device's shard) from the byte ranges it needs,
`TensorMap.to_hf` gives a Hugging Face tensor back from the part of the array that holds it. Both are exact (no
arithmetic), so import -> export is bit-exact.

A mixture of experts' block holds the router `[embed, experts]` (Hugging Face's `[experts, embed]`
`gate.weight`) and each expert projection stacked over the experts, `[experts, embed, hidden]`, where
the checkpoint has one tensor per expert (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`,
Qwen3-MoE's `mlp.experts.{e}.gate_proj/up_proj/down_proj`): the expert axis is one more stacked axis.

Query head `h` reads key/value head `h // (heads / kv_heads)` in both (Hugging Face's
`repeat_kv`), and both use the "rotate half" rotary layout, so no column permutation is needed.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from equipax.models.configs import LMConfig
from equipax.models.hf.config import model_type_of

__all__ = ["hf_names", "locate", "ROUTER_BIAS", "TensorMap", "tensor_maps", "TensorReader"]


@runtime_checkable
class TensorReader(Protocol):
    """What a `TensorMap` reads from (`HFCheckpoint`)."""

    def read(self, name: str, index: tuple[slice, ...] = (), *, view: tuple[int, ...] | None = None) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One equipax array as Hugging Face tensors.

    Attributes:
        names: the tensor filling each position of the array's stacked axes (an object array).
        name_axes: the array's axes that `names` indexes, in order.
        view: the shape each tensor is read as (a reshape of its C-order data).
        perm: the array's other axes are `view` transposed by `perm`.
        hf_shape: each tensor's shape in the checkpoint.
    """

    names: np.ndarray
    name_axes: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]
    hf_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The equipax array's shape."""
        trailing = iter(self.view[p] for p in self.perm)
        stacked = iter(self.names.shape)
        ndim = len(self.name_axes) + len(self.perm)
        return tuple(next(stacked) if a in self.name_axes else next(trailing) for a in range(ndim))

    def read(self, reader: TensorReader, index: tuple[slice, ...] = ()) -> np.ndarray:
        """`array[index]` read from the checkpoint (only the rows each tensor's part needs).

        Arguments:
            reader: the checkpoint.
            index: one slice per axis of the equipax array (step 1); missing axes are whole.

        Returns:
            The part of the array, in the checkpoint's dtype.
        """
        shape = self.shape
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        stacked = [index[a] for a in self.name_axes]
        trailing = [s for a, s in enumerate(index) if a not in self.name_axes]
        view_index = [slice(None)] * len(self.view)
        for k, p in enumerate(self.perm):
            view_index[p] = trailing[k]
        names = np.asarray(self.names[tuple(stacked)], dtype=object)
        parts = [reader.read(n, tuple(view_index), view=self.view).transpose(self.perm) for n in names.reshape(-1)]
        block = np.stack(parts).reshape(names.shape + parts[0].shape)
        # Stacked axes first -> each to its place among the array's axes.
        return np.moveaxis(block, tuple(range(names.ndim)), self.name_axes)

    def index_of(self, pos: tuple[int, ...]) -> tuple[int | slice, ...]:
        """The index of the equipax array that holds the tensor `names[pos]`."""
        it = iter(pos)
        return tuple(
            next(it) if a in self.name_axes else slice(None) for a in range(len(self.name_axes) + len(self.perm))
        )

    def to_hf(self, part: np.ndarray) -> np.ndarray:
        """The Hugging Face tensor of `array[index_of(pos)]` (C order, `hf_shape`)."""
        return np.ascontiguousarray(np.asarray(part).transpose(tuple(np.argsort(self.perm)))).reshape(self.hf_shape)


# A block's arrays: equipax path inside the block -> (tensor names inside layer i, view, perm, hf
# shape, and where the axis the names run along sits among the array's own axes: k/v after the
# embedding axis, experts first; None for one tensor).
_BlockMap = tuple[list[str], tuple[int, ...], tuple[int, ...], tuple[int, ...], int | None]
# Each model type's mixture-of-experts tensors: (the block's prefix, gate, up, down names of expert e).
_EXPERTS = {
    "mixtral": ("block_sparse_moe", "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp", "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"),
}


def _block_maps(cfg: LMConfig) -> dict[str, _BlockMap]:
    t = cfg.transformer
    d, h, kv, hd, f = t.model_dims, t.num_heads, t.kv_heads, t.head_dim, t.hidden_dims
    a = "self_attn"
    maps: dict[str, _BlockMap] = {
        ".atten_norm.scale": (["input_layernorm.weight"], (d,), (0,), (d,), None),
        ".ffn_norm.scale": (["post_attention_layernorm.weight"], (d,), (0,), (d,), None),
        ".attention.q": ([f"{a}.q_proj.weight"], (h, hd, d), (2, 0, 1), (h * hd, d), None),
        ".attention.kv": ([f"{a}.k_proj.weight", f"{a}.v_proj.weight"], (kv, hd, d), (2, 0, 1), (kv * hd, d), 1),
        ".attention.out": ([f"{a}.o_proj.weight"], (d, h, hd), (1, 2, 0), (d, h * hd), None),
    }
    if t.num_experts:
        prefix, gate, up, down = _EXPERTS[model_type_of(cfg)]
        e, g = t.num_experts, t.expert_hidden_dims
        experts = range(e)
        maps |= {
            ".ffn.router": ([f"{prefix}.gate.weight"], (e, d), (1, 0), (e, d), None),
            ".ffn.gate": ([f"{prefix}.{gate.format(e=i)}" for i in experts], (g, d), (1, 0), (g, d), 0),
            ".ffn.up": ([f"{prefix}.{up.format(e=i)}" for i in experts], (g, d), (1, 0), (g, d), 0),
            ".ffn.down": ([f"{prefix}.{down.format(e=i)}" for i in experts], (d, g), (1, 0), (d, g), 0),
        }
    else:
        maps |= {
            ".ffn.gate.weight": (["mlp.gate_proj.weight"], (f, d), (1, 0), (f, d), None),
            ".ffn.up.weight": (["mlp.up_proj.weight"], (f, d), (1, 0), (f, d), None),
            ".ffn.down.weight": (["mlp.down_proj.weight"], (d, f), (1, 0), (d, f), None),
        }
    if t.qk_norm:
        maps[".attention.q_norm.scale"] = ([f"{a}.q_norm.weight"], (hd,), (0,), (hd,), None)
        maps[".attention.k_norm.scale"] = ([f"{a}.k_norm.weight"], (hd,), (0,), (hd,), None)
    return maps


def hf_names(cfg: LMConfig) -> list[str]:
    """The Hugging Face tensors of a model of `cfg`, in the order an export writes them (layer by layer)."""
    block = [n for names, *_ in _block_maps(cfg).values() for n in names]
    layers = [f"model.layers.{i}.{n}" for i in range(cfg.transformer.num_layers) for n in block]
    head = [] if cfg.tie_embeddings else ["lm_head.weight"]
    return ["model.embed_tokens.weight", *layers, "model.norm.weight", *head]


ROUTER_BIAS = ".ffn.router_bias"
_STACKED = re.compile(r"^\.stack\.(layers|stages)(\[(\d+)\])?(\..+)$")


def tensor_maps(cfg: LMConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorMap]:
    """The `TensorMap` of each array of a `TransformerLM` of `cfg`.

    Arguments:
        cfg: the model config (Llama-style: `equipax.models.hf.config.model_type_of`).
        shapes: the model's arrays by path (`jax.tree_util.keystr` of the path, as checkpoints name
            them: `.embedding.weight`, `.stack.layers.attention.q`, ...) and their shapes.

    Returns:
        path -> TensorMap; every array of the model has one, but the routing biases of
        auxiliary-loss-free balancing (`ROUTER_BIAS`: no Hugging Face Mixtral or Qwen3-MoE tensor;
        an import starts them at zero).

    Raises:
        ValueError: an array this module has no Hugging Face equivalent for (a bug: the configs it
            is called with are checked first).
    """
    t = cfg.transformer
    v, d = cfg.vocab_size, t.model_dims
    block = _block_maps(cfg)
    out: dict[str, TensorMap] = {}
    for path, shape in shapes.items():
        if path.endswith(ROUTER_BIAS):
            continue
        if path == ".embedding.weight":
            out[path] = TensorMap(np.array("model.embed_tokens.weight", object), (), (v, d), (0, 1), (v, d))
        elif path == ".unembed.weight":
            out[path] = TensorMap(np.array("lm_head.weight", object), (), (v, d), (1, 0), (v, d))
        elif path == ".final_norm.scale":
            out[path] = TensorMap(np.array("model.norm.weight", object), (), (d,), (0,), (d,))
        elif (m := _STACKED.match(path)) and m.group(4) in block:
            names, view, perm, hf_shape, names_at = block[m.group(4)]
            if m.group(1) == "stages":  # [stage, repeat, layer in stage]: model layer (r S + s) L + j
                s, r, per = shape[:3]
                layers = np.array(
                    [[[(ri * s + si) * per + j for j in range(per)] for ri in range(r)] for si in range(s)]
                )
            elif m.group(3) is not None:  # unrolled: one block per layer
                layers = np.array(int(m.group(3)))
            else:
                layers = np.arange(shape[0])
            full = np.empty((*layers.shape, len(names)), object)
            for pos in np.ndindex(layers.shape):
                full[pos] = [f"model.layers.{layers[pos]}.{n}" for n in names]
            lead = tuple(range(layers.ndim))
            if names_at is None:
                out[path] = TensorMap(full[..., 0], lead, view, perm, hf_shape)
            else:  # key and value (the `2` axis after the embedding axis), or the experts (first)
                out[path] = TensorMap(full, (*lead, layers.ndim + names_at), view, perm, hf_shape)
        else:
            raise ValueError(f"no Hugging Face tensor for the model's array {path!r}")
        if out[path].shape != tuple(shape):
            raise ValueError(f"{path}: the mapping gives shape {out[path].shape}, the model has {tuple(shape)}")
    return out


def locate(maps: Mapping[str, TensorMap]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every Hugging Face tensor the maps read -> (equipax path, position in its `names`)."""
    return {str(m.names[pos]): (path, pos) for path, m in maps.items() for pos in np.ndindex(m.names.shape)}
